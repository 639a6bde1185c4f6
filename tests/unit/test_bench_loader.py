"""`raydl bench loader`: the end-to-end run on a tiny folder, and its pure parts."""
from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
from PIL import Image

from raydl.bench import loader
from raydl.bench._transform import rrc_params, train_transform
from raydl.bench.report import format_table, short_window, summarize


def _tiny_folder(root, n: int = 40):
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:03d}.jpg", quality=85)
    (root / "labels.csv").write_text("not an image\n")  # listing must skip it
    return root


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loader.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["loader", *argv])


@pytest.mark.timeout(300)
def test_bench_writes_a_row_per_peer_with_positive_throughput(tmp_path):
    """raydl and torch each run two epochs of 40 images: a JSON row of the first with images/s > 0, the second's
    figures apart, and raydl's CPU split by process."""
    data = _tiny_folder(tmp_path / "data")
    out = tmp_path / "bench.json"
    args = _parse(["--data", str(data), "--compare", "torch", "--rounds", "1", "--cpus", "1",
                   "--batch-size", "8", "--epochs", "2", "--json", str(out)])
    rc = loader.main(args)
    report = json.loads(out.read_text())
    rows = {row["peer"]: row for row in report["summary"]}
    assert {"raydl", "torch"} <= rows.keys(), report
    for peer in ("raydl", "torch"):
        assert rows[peer]["images_per_s"] and rows[peer]["images_per_s"] > 0, report["runs"]
    raydl_runs = [r for r in report["runs"] if r["peer"] == "raydl" and r["ok"]]
    if any(short_window(r) for r in raydl_runs):  # 40 images: usually too short a window for a ratio
        assert rows["raydl"]["short_window"] and rows["torch"]["ratio_to_raydl"] is None
    else:
        assert rows["raydl"]["ratio_to_raydl"] == pytest.approx(1.0)
    assert all(r["first_batch_from_start_s"] > r["first_batch_s"] > 0 for r in raydl_runs)
    assert all(r["peak_pss_by_process_mib"]["this process"] > 0 for r in raydl_runs)
    # raydl's own processes and Ray's services apart, each at most the whole tree's peak (epoch 1 and all)
    for run in raydl_runs:
        assert 0 < run["own_pss_mib"] <= run["peak_pss_mib"] + 1 and 0 < run["ray_pss_mib"] <= run["peak_pss_mib"] + 1
        assert run["later_own_pss_mib"] >= run["own_pss_mib"] and run["later_ray_pss_mib"] >= run["ray_pss_mib"]
    torch_runs = [r for r in report["runs"] if r["peer"] == "torch" and r["ok"]]
    assert all(r["ray_pss_mib"] == 0 and r["own_pss_mib"] > 0 for r in torch_runs)  # no Ray
    assert rows["raydl"]["own_pss_mib"] > 0 and rows["raydl"]["ray_pss_mib"] > 0
    assert any(note.startswith("own PSS MiB: the peak of the peer's own") and "x torch" in note
               for note in report["notes"]), report["notes"]
    assert all(isinstance(r["peak_shmem_by_process_mib"], dict) for r in raydl_runs)
    made_here = {"listing", "loader()", "to task", "task", "hand-over"}  # the driver's first task (bootstrap)
    assert all(set(r["first_batch_phases_s"]) in ({"listing", "loader()", "batch"}, made_here) for r in raydl_runs)
    assert all(r["ray_init_s"] > 0 for r in raydl_runs)
    assert any(note.startswith("raydl start-up from process start (a local Ray") for note in report["notes"])
    assert any(note.startswith("raydl first batch, per round") for note in report["notes"])
    assert any(note.startswith("raydl peak PSS by process") for note in report["notes"])
    assert all(r["images"] == 40 for r in report["runs"] if r["ok"]), report["runs"]
    for run in (r for r in report["runs"] if r["ok"] and r["peer"] in ("raydl", "torch")):  # --epochs 2
        assert run["later_images"] == 40 and run["later_images_per_s"] > 0 and run["later_cpu_s_per_image"] > 0, run
    for run in raydl_runs:  # where the CPU went, per kind of process, after the first batch and in epoch 2
        for key in ("steady_cpu_ms_per_image_by_process", "later_cpu_ms_per_image_by_process"):
            assert run[key] and all(v >= 0 for v in run[key].values()), (key, run)
    assert any(note.startswith("raydl later CPU by process") for note in report["notes"]), report["notes"]
    assert rc == 0


@pytest.mark.timeout(300)
def test_bench_runs_raydl_on_simulated_nodes(tmp_path):
    """--nodes 2: the raydl row runs on a local 2-node Cluster, delivers every image and notes it."""
    data = _tiny_folder(tmp_path / "data", n=16)
    out = tmp_path / "bench.json"
    args = _parse(["--data", str(data), "--compare", "", "--no-ceiling", "--rounds", "1", "--cpus", "2",
                   "--nodes", "2", "--batch-size", "8", "--json", str(out)])
    assert loader.main(args) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["peer"] == "raydl" and run["ok"] and run["images"] == 16, run
    assert any("2-node" in note for note in report["notes"])


@pytest.mark.timeout(10)
def test_rrc_window_always_fits_the_image():
    """Every crop window, including the centre-crop fallback for extreme shapes, lies inside the image."""
    rng = random.Random(0)
    for width, height in [(500, 375), (10, 400), (400, 10), (1, 1), (224, 224)]:
        for _ in range(200):
            top, left, h, w = rrc_params(width, height, rng)
            assert 0 < h and 0 < w and 0 <= top <= height - h and 0 <= left <= width - w


@pytest.mark.timeout(10)
def test_train_transform_writes_a_normalized_chw_slot():
    """A mid-grey image becomes (3, 224, 224) float32 equal to (0.5 - mean) / std per channel."""
    out = np.zeros((3, 224, 224), np.float32)
    train_transform(Image.new("RGB", (300, 200), (128, 128, 128)), random.Random(1), out)
    want = (128 / 255 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(out.mean(axis=(1, 2)), want, atol=1e-5)


@pytest.mark.timeout(10)
def test_summary_takes_medians_and_ratios_to_raydl():
    """Medians skip failed rounds; each peer's images/s is divided by raydl's median."""
    runs = [
        {"peer": "raydl", "ok": True, "images_per_s": 100.0, "first_batch_s": 1.0,
         "peak_pss_mib": 10.0, "cpu_s_per_image": 0.01},
        {"peer": "raydl", "ok": True, "images_per_s": 300.0, "first_batch_s": 3.0,
         "peak_pss_mib": 30.0, "cpu_s_per_image": 0.03},
        {"peer": "torch", "ok": True, "images_per_s": 100.0, "first_batch_s": 2.0,
         "peak_pss_mib": 20.0, "cpu_s_per_image": 0.02},
        {"peer": "torch", "ok": False, "error": "boom\ntraceback"},
    ]
    rows = {r["peer"]: r for r in summarize(["raydl", "torch"], runs)}
    assert rows["raydl"]["images_per_s"] == 200.0
    assert rows["torch"]["ratio_to_raydl"] == 0.5
    assert (rows["torch"]["rounds_ok"], rows["torch"]["rounds"]) == (1, 2)
    table = format_table(list(rows.values()), header="h")
    assert "torch failed: boom" in table and "1/2" in table


@pytest.mark.timeout(10)
def test_a_short_measurement_window_is_greyed_and_gets_no_ratio():
    """A run measured over < 1 s or < 3 batches shows images/s in brackets and no ratio, for itself and against it."""
    fast = {"ok": True, "images_per_s": 210123.0, "first_batch_s": 1.0, "peak_pss_mib": 1.0,
            "cpu_s_per_image": 0.001, "steady_s": 0.002, "steady_batches": 1}
    slow = {"ok": True, "images_per_s": 500.0, "first_batch_s": 1.0, "peak_pss_mib": 1.0,
            "cpu_s_per_image": 0.001, "steady_s": 8.0, "steady_batches": 15}
    rows = summarize(["raydl", "torch"], [{"peer": "raydl", **fast}, {"peer": "torch", **slow}])
    assert [r["ratio_to_raydl"] for r in rows] == [None, None] and rows[0]["short_window"]
    table = format_table(rows, header="h")
    assert "(210123.0)" in table and "0.00" not in table and "not comparable" in table
    rows = summarize(["raydl", "torch"], [{"peer": "raydl", **slow}, {"peer": "torch", **fast}])
    assert rows[0]["ratio_to_raydl"] == 1.0 and rows[1]["ratio_to_raydl"] is None


@pytest.mark.timeout(10)
def test_processes_are_named_by_ray_title_or_program():
    """The per-process PSS split names Ray actors by title and Ray services by program, never by 'python'."""
    from raydl.bench._runner import process_kind

    py = "/venv/bin/python3.11"
    assert process_kind(["ray::LoaderWorker.run_batch", ""]) == "ray::LoaderWorker"
    assert process_kind(["ray::IDLE"]) == "ray::IDLE"
    assert process_kind(["/venv/lib/ray/core/src/ray/raylet/raylet", "--node-id=x"]) == "raylet"
    assert process_kind(["/venv/lib/ray/core/src/ray/gcs/gcs_server", "--x"]) == "gcs_server"
    assert process_kind([py, "-u", "/venv/lib/ray/dashboard/agent.py", "--x"]) == "dashboard/agent.py"
    assert process_kind([py, "/venv/lib/ray/_private/log_monitor.py", "--x"]) == "log_monitor.py"
    assert process_kind([]) == "?"


@pytest.mark.timeout(10)
def test_process_note_splits_raydl_from_ray():
    """The note sums the driver, the workers and the coordinator apart from Ray's own processes."""
    run = {"round": 1, "peak_pss_by_process_mib": {"ray::LoaderWorker": 600.0, "this process": 150.0,
                                                   "raylet": 20.0, "ray::LoaderCoordinator": 60.0,
                                                   "ray::DashboardAgent": 80.0},
           "peak_shmem_by_process_mib": {"ray::LoaderWorker": 290.0}}
    note = loader._process_note(run)
    assert "LoaderWorker 600 (290 shared)" in note and note.endswith("raydl's processes 810, Ray's own 100")


@pytest.mark.timeout(10)
def test_pss_splits_out_shared_memory():
    """A process's PSS, and the part of it in shared memory (the object store's pages), both in bytes."""
    import mmap

    import psutil

    from raydl.bench._runner import _pss

    shm = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)  # shmem, like /dev/shm
    shm.write(b"x" * (8 << 20))
    pss, shmem = _pss(psutil.Process())
    assert pss > shmem >= 4 << 20
    shm.close()


@pytest.mark.timeout(10)
def test_epoch_clock_keeps_the_first_epoch_and_times_the_later_ones_apart():
    """EpochClock(epochs=3): the measurement is epoch 1's; epochs 2-3 are counted apart; the hooks fire once, in order."""
    from raydl.bench._clock import EpochClock, stand_in

    calls = []
    clock = EpochClock(20, on_start=lambda: calls.append("start"), on_finish=lambda: calls.append("finish"),
                       on_first=lambda: calls.append("first"), epochs=3,
                       on_first_epoch=lambda: calls.append("epoch1"))
    clock.start()
    for _ in range(3 * 2):
        clock.batch(stand_in(10, (3,)))
    m = clock.result()
    assert calls == ["start", "first", "epoch1", "finish"]
    assert (m.images, m.steady_images, m.batches, m.later_images) == (20, 10, 2, 40)
    assert m.later_s >= 0 and m.steady_s >= 0
    one = EpochClock(20, on_start=lambda: None, on_finish=lambda: None)
    one.start()
    for _ in range(2):
        one.batch(stand_in(10, (3,)))
    assert one.result().later_images == 0  # one epoch: nothing apart, as before


@pytest.mark.timeout(10)
def test_a_pause_after_the_first_epoch_is_in_no_epochs_window():
    """resume_later(): the later epochs' time starts after the pause (raydl's refresh() between epochs 1
    and 2, a one-off start-up), and the sampler's baseline is taken again then."""
    import time

    from raydl.bench._clock import EpochClock, stand_in

    marks = []
    clock = EpochClock(20, on_start=lambda: None, on_finish=lambda: None, epochs=2,
                       on_first_epoch=lambda: marks.append(time.perf_counter()))
    clock.start()
    for _ in range(2):
        clock.batch(stand_in(10, (3,)))
    time.sleep(1.0)  # the pause
    clock.resume_later()
    for _ in range(2):
        clock.batch(stand_in(10, (3,)))
    m = clock.result()
    assert len(marks) == 2 and marks[1] - marks[0] >= 1.0
    assert m.later_images == 20 and m.later_s < 0.5  # the pause is not in it


@pytest.mark.timeout(30)
def test_process_start_is_when_the_process_started_not_a_second_early():
    """"From start" figures count from the process's start: a child's start as the helper gives it is at
    most a few ticks before the first line of its script runs (psutil's create_time can be a second early
    where the boot time is not whole seconds)."""
    import subprocess
    import sys
    import time

    script = (
        "import time; t = time.time()\n"
        "from raydl.bench._clock import process_start_time\n"
        "print(process_start_time(), t)\n"
    )
    for _ in range(3):
        launched = time.time()
        start, first_line = map(float, subprocess.run([sys.executable, "-c", script], capture_output=True,
                                                      text=True, check=True).stdout.split())
        # between the launch and the script's first line, however long the interpreter took to start on a
        # busy machine; a tick of rounding either way
        assert launched - 0.02 <= start <= first_line + 0.02, (launched, start, first_line)


@pytest.mark.timeout(10)
def test_table_shows_own_and_ray_memory_next_to_the_total():
    """'own PSS MiB' and 'Ray PSS MiB' follow 'peak PSS MiB', medians over the rounds; '-' where a row has none."""
    runs = [
        {"peer": "raydl", "ok": True, "images_per_s": 100.0, "first_batch_s": 1.0, "peak_pss_mib": 1300.0,
         "own_pss_mib": 912.0, "ray_pss_mib": 388.0, "cpu_s_per_image": 0.002},
        {"peer": "dataio", "ok": True, "images_per_s": 80.0, "first_batch_s": 1.0, "peak_pss_mib": 985.0,
         "own_pss_mib": 985.0, "ray_pss_mib": 0.0, "cpu_s_per_image": 0.003},
        {"peer": "torch", "ok": True, "images_per_s": 80.0, "first_batch_s": 1.0, "peak_pss_mib": 700.0,
         "cpu_s_per_image": 0.003},
    ]
    summary = summarize(["raydl", "dataio", "torch"], runs)
    table = format_table(summary, header="h")
    head = next(line for line in table.splitlines() if line.startswith("peer"))
    assert head.index("peak PSS MiB") < head.index("own PSS MiB") < head.index("Ray PSS MiB")
    line = next(x for x in table.splitlines() if x.startswith("raydl")).split()
    assert line[5:8] == ["1300", "912", "388"], line
    assert next(x for x in table.splitlines() if x.startswith("torch")).split()[6:8] == ["-", "-"]
    note = loader._own_memory_note(summary, epochs=3)
    assert "0.93x dataio" in note and "later_own_pss_mib: all 3 epochs" in note


@pytest.mark.timeout(10)
def test_ray_services_are_told_from_the_loaders_own_processes():
    """GCS, raylet, agents, monitors and idle workers are Ray's; the runner and any loader actor are the peer's."""
    from raydl.bench.report import ray_service

    for kind in ("raylet", "gcs_server", "ray::IDLE", "ray::IDLE_SpillWorker", "ray::DashboardAgent",
                 "ray::RuntimeEnvAgent", "dashboard/agent.py", "log_monitor.py", "monitor.py", "dashboard.py"):
        assert ray_service(kind), kind
    for kind in ("this process", "ray::LoaderWorker", "ray::LoaderCoordinator", "ray::MapBatches", "python3"):
        assert not ray_service(kind), kind


@pytest.mark.timeout(10)
def test_later_epoch_columns_show_only_with_several_epochs():
    """The table gets 'later img/s' and 'later CPU ms/img' columns when a row has them, '-' for peers without."""
    runs = [
        {"peer": "raydl", "ok": True, "images_per_s": 100.0, "first_batch_s": 1.0, "peak_pss_mib": 10.0,
         "cpu_s_per_image": 0.002, "steady_cpu_s_per_image": 0.0018, "later_images_per_s": 150.0,
         "later_cpu_s_per_image": 0.0015},
        {"peer": "datago", "ok": True, "images_per_s": 80.0, "first_batch_s": 1.0, "peak_pss_mib": 10.0,
         "cpu_s_per_image": 0.003, "steady_cpu_s_per_image": 0.003},
    ]
    table = format_table(summarize(["raydl", "datago"], runs), header="h")
    assert "later img/s" in table and "later CPU ms/img" in table
    rows = format_table(summarize(["raydl", "datago"], runs), header="h", rate="rows/s", tokens_per_sample=8)
    assert "later rows/s" in rows and "steady CPU ms/row" in rows and "ms/img" not in rows
    windows = format_table(summarize(["raydl", "datago"], runs), header="h", rate="windows/s")
    assert "CPU ms/window" in windows and "later windows/s" in windows and "img" not in windows
    raydl_line = next(line for line in table.splitlines() if line.startswith("raydl"))
    assert "150.0" in raydl_line and "1.50" in raydl_line
    for run in runs:
        run.pop("later_images_per_s", None), run.pop("later_cpu_s_per_image", None)
    assert "later" not in format_table(summarize(["raydl", "datago"], runs), header="h")


@pytest.mark.timeout(10)
def test_batch_size_gives_several_batches_or_says_how_many_images_it_needs():
    """Without --batch-size the default 256 shrinks so the images make 8 batches; a batch size that leaves fewer
    than 2 batches (no rate to measure) is a ValueError naming the images needed."""
    assert loader.batch_size_for(None, 100_000) == 256
    assert loader.batch_size_for(None, 100) == 12 and loader.batch_size_for(None, 10) == 1
    assert loader.batch_size_for(32, 64) == 32
    with pytest.raises(ValueError, match=r"100 image\(s\) make 1 batch of 256.*at least 512 images.*--batch-size 50"):
        loader.batch_size_for(256, 100)
    with pytest.raises(ValueError, match="at least 2 images"):
        loader.batch_size_for(None, 1)


@pytest.mark.timeout(30)
def test_bench_refuses_a_folder_of_one_batch_before_running_anything(tmp_path, capsys, monkeypatch):
    """--batch-size larger than half the folder: exit 2 with the message, and no peer is run (no 0.0 img/s rows)."""
    data = _tiny_folder(tmp_path / "data", n=10)
    monkeypatch.setattr(loader, "_run_once", lambda *a, **k: pytest.fail("a peer ran"))
    assert loader.main(_parse(["--data", str(data), "--compare", "torch", "--batch-size", "8"])) == 2
    assert "10 image(s) make 1 batch of 8" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_bench_on_a_small_folder_picks_a_batch_size_that_measures(tmp_path, capsys):
    """40 images and no --batch-size: raydl runs batches of 5 (8 batches) and measures images/s > 0."""
    data = _tiny_folder(tmp_path / "data")
    out = tmp_path / "bench.json"
    args = _parse(["--data", str(data), "--compare", "", "--no-ceiling", "--rounds", "1", "--cpus", "1",
                   "--json", str(out)])
    assert loader.main(args) == 0
    report = json.loads(out.read_text())
    assert report["batch_size"] == 5 and report["summary"][0]["images_per_s"] > 0, report
    assert "batch 5: 40 images make 8 batches" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_clip_shards_hold_the_image_a_caption_and_metadata_per_sample(tmp_path):
    """write_clip_shards: TarWriter shards whose samples, as webdataset decodes them, are the folder's JPEGs in
    sorted order, a 50-200 character caption and ~300 bytes of JSON, the same on every write."""
    import webdataset as wds

    from raydl.bench._clip import caption, clip_count, clip_shards, write_clip_shards
    from raydl.bench._transform import list_images

    data = _tiny_folder(tmp_path / "data", n=6)
    shards = write_clip_shards(str(data), str(tmp_path / "clip"), per_shard=4)
    assert [p.rsplit("/", 1)[1] for p in shards] == ["shard-000000.tar", "shard-000001.tar"]
    assert clip_shards(str(tmp_path / "clip")) == shards and clip_count(str(tmp_path / "clip")) == 6
    images = list_images(str(data))
    samples = list(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(6)]
    for i, s in enumerate(samples):
        assert s["jpg"] == open(images[i], "rb").read()
        text = s["txt"].decode()
        assert text == caption(0, i) and 50 <= len(text) <= 200
        assert 250 <= len(s["json"]) <= 400
        meta = json.loads(s["json"])
        with Image.open(images[i]) as img:
            assert (meta["key"], meta["width"], meta["height"]) == (s["__key__"], *img.size)
    again = write_clip_shards(str(data), str(tmp_path / "again"), per_shard=4)
    assert [open(p, "rb").read() for p in again] == [open(p, "rb").read() for p in shards]


@pytest.mark.timeout(60)
def test_token_parquet_holds_rows_of_2048_int32_tokens(tmp_path):
    """write_token_parquet: the rows split over the files in row groups of at most row_group, one list<int32>
    column of 2,048 ids below the vocabulary each; _to_numpy makes (rows, 2048) of a slice too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydl.bench._tokens import SEQ_LEN, VOCAB, _to_numpy, token_files, token_rows, write_token_parquet

    paths = write_token_parquet(str(tmp_path / "tok"), rows=10, files=3, row_group=2)
    assert (
        token_files(str(tmp_path / "tok")) == paths
        and len(paths) == 3
        and token_rows(str(tmp_path / "tok")) == 10
    )
    for path in paths:
        pf = pq.ParquetFile(path)
        assert pf.schema_arrow.field("input_ids").type == pa.list_(pa.int32())
        assert all(pf.metadata.row_group(g).num_rows <= 2 for g in range(pf.num_row_groups))
        column = pf.read()["input_ids"]
        tokens = _to_numpy(column)
        assert tokens.shape == (pf.metadata.num_rows, SEQ_LEN) and tokens.dtype == np.int32
        assert 0 <= tokens.min() and tokens.max() < VOCAB
        np.testing.assert_array_equal(_to_numpy(column.combine_chunks().slice(1, 2)), tokens[1:3])
    again = write_token_parquet(str(tmp_path / "again"), rows=10, files=3, row_group=2)
    for a, b in zip(paths, again, strict=True):
        assert pq.read_table(a).equals(pq.read_table(b))


@pytest.mark.timeout(120)
def test_token_and_clip_peers_without_ray_deliver_the_workload(tmp_path):
    """On a tiny set, the torch DataLoader and pyarrow rows of "tokens" hand over every row as (B, 2048) int32,
    and webdataset + DataLoader of "clip" every image as float32 (B, 3, 224, 224) with its caption."""
    from raydl.bench._clip import run_wds_torch, write_clip_shards
    from raydl.bench._clock import EpochClock, PeerSpec
    from raydl.bench._tokens import run_pyarrow_ceiling, run_torch_tokens, write_token_parquet

    write_token_parquet(str(tmp_path / "tok"), rows=20, files=2, row_group=4)
    for run in (run_torch_tokens, run_pyarrow_ceiling):
        spec = PeerSpec(
            data=str(tmp_path / "tok"), cpus=1, batch_size=8, seed=0, expected=20, workload="tokens"
        )
        m = run(spec, EpochClock(20, on_start=lambda: None, on_finish=lambda: None))
        assert (m.images, m.batch_shape, m.batch_dtype) == (20, (8, 2048), "int32"), (run.__name__, m)
    write_clip_shards(str(_tiny_folder(tmp_path / "data", n=8)), str(tmp_path / "clip"), per_shard=4)
    spec = PeerSpec(data=str(tmp_path / "clip"), cpus=1, batch_size=4, seed=0, expected=8, workload="clip")
    m = run_wds_torch(spec, EpochClock(8, on_start=lambda: None, on_finish=lambda: None))
    assert (m.images, m.batch_shape, m.batch_dtype) == (8, (4, 3, 224, 224), "float32"), m


@pytest.mark.timeout(10)
def test_clip_and_tokens_runs_pick_their_rows_and_notes(tmp_path):
    """clip adds raydl-image and no JPEG ceiling; tokens adds raydl-ordered and the pyarrow ceiling; the notes give what the caption
    costs raydl, tokens/s and raydl's ratios against the goals."""
    peers, _ = loader._peers(_parse(["--data", "x", "--workload", "clip", "--compare", "torch,raydata"]))
    assert peers == ["raydl", "raydl-image", "torch", "raydata"]
    peers, _ = loader._peers(_parse(["--data", "x", "--workload", "tokens", "--compare", "torch,dataio"]))
    assert peers == ["raydl", "raydl-ordered", "torch", "ceiling"]
    row = lambda peer, ips: {"peer": peer, "images_per_s": ips, "short_window": False}  # noqa: E731
    notes = loader._workload_notes(
        "clip", [row("raydl", 96.0), row("raydl-image", 100.0), row("torch", 40.0)]
    )
    assert (
        notes[0].startswith("carrying caption + metadata costs raydl 4.0%") and "2.40 (goal >= 2)" in notes[1]
    )
    notes = loader._workload_notes(
        "tokens", [row("raydl", 1000.0), row("ceiling", 1250.0), row("raydata", 250.0)]
    )
    assert "raydl 2.0 M, ceiling 2.6 M" in notes[0] and notes[1:] == [
        "raydl / pyarrow ceiling: 0.80 (goal >= 0.7)",
        "raydl / Ray Data: 4.00 (goal >= 1.0)",
        "raydl / peer, after the first batch (whole epoch from process start): ceiling 0.80 (-), raydata 4.00 (-)",
    ]
    (tmp_path / "empty").mkdir()
    assert loader.main(_parse(["--data", str(tmp_path / "empty"), "--workload", "tokens"])) == 2


@pytest.mark.timeout(60)
def test_bench_tokens_part_rows_measures_the_rows_table_alone(tmp_path, monkeypatch):
    """--workload tokens --part rows: only the rows table, with raydl, raydl without its shuffle and the
    pyarrow ceiling as its peers, and no Megatron corpus written (the peers' runs themselves are
    test_bench_tokens_both_tables_every_peer_the_same_tokens's)."""
    from raydl.bench._tokens import write_token_parquet

    write_token_parquet(str(tmp_path / "tok"), rows=256, files=2, row_group=64)
    tables = []
    monkeypatch.setattr(loader, "_table", lambda part, peers, skipped, files, plot: (
        tables.append((part.workload, list(peers), len(files))) or (0, {"rows": True})))
    out = tmp_path / "bench.json"
    args = _parse(["--data", str(tmp_path / "tok"), "--workload", "tokens", "--compare", "", "--rounds", "1",
                   "--cpus", "1", "--batch-size", "32", "--part", "rows", "--json", str(out)])  # fmt: skip
    assert loader.main(args) == 0
    assert tables == [("tokens", ["raydl", "raydl-ordered", "ceiling"], 256)]
    assert json.loads(out.read_text()) == {"workload": "tokens", "rows": True}
    assert not (tmp_path / "megatron").exists()


@pytest.mark.timeout(600)
def test_bench_tokens_both_tables_every_peer_the_same_tokens(tmp_path, capsys):
    """--workload tokens on a tiny set: the rows table (Parquet) and the windows table (a Megatron corpus the
    bench writes) each have every available peer with positive rates after the first batch, over the whole
    epoch from process start and over the second epoch (Ray Data's pipeline run again); every peer of a table
    but the floor delivers the same rows or windows (the digest of every token delivered over the epoch equals
    the ceiling's)."""
    import importlib.util

    from raydl.bench._tokens import write_token_parquet

    write_token_parquet(str(tmp_path / "d" / "tokens"), rows=96, files=2, row_group=16)
    out = tmp_path / "bench.json"
    megatron = importlib.util.find_spec("megatron.core") is not None
    args = _parse(
        ["--data", str(tmp_path / "d"), "--workload", "tokens", "--compare", "torch,raydata,megatron,floor",
         "--rounds", "1", "--cpus", "2", "--batch-size", "8", "--megatron-tokens", "400000", "--seq-len", "512",
         "--window-batch-size", "8", "--checksum", "--epochs", "2", "--json", str(out)]
    )  # fmt: skip
    assert loader.main(args) == 0
    assert (tmp_path / "d" / "megatron" / "corpus-400000.idx").exists()
    printed = capsys.readouterr().out
    assert "rows of 2048 tokens from Parquet" in printed and "windows of 512 tokens from a Megatron corpus" in printed
    report = json.loads(out.read_text())
    windows = report["windows"]
    for part, peers, n, shape in (
        (report, ["raydl", "raydl-ordered", "torch", "raydata", "ceiling"], 96, 2048),
        (windows, ["raydl", "torch", "raydata", *(["megatron"] if megatron else []), "floor", "ceiling"], 781, 512),
    ):
        assert [r["peer"] for r in part["summary"]] == peers, part["summary"]
        for r in part["runs"]:
            assert r["ok"] and r["images"] == n and r["batch_shape"][1:] == [shape], r
            assert r["images_per_s"] > 0 and r["epoch_from_start_per_s"] > 0, r
            assert r["later_images"] == n and r["later_images_per_s"] > 0, r  # --epochs 2: every peer here
        ceiling = next(r["checksum"] for r in part["runs"] if r["peer"] == "ceiling")
        readers = [p for p in peers if p != "floor"]  # the floor hands over one batch again and again
        got = {r["peer"]: r["checksum"] for r in part["runs"] if r["peer"] != "floor"}
        assert got == dict.fromkeys(readers, ceiling)
    if not megatron:  # skipped with its reason, never silently
        assert any(n.startswith("megatron skipped") for n in windows["notes"]), windows["notes"]
    assert any("megatron-core's IndexedDataset reads Megatron corpora" in n for n in report["notes"])
    assert any(n.startswith("raydl / peer, after the first batch") for n in windows["notes"])
    assert any(n.startswith("raydl / the object-store floor, after the first batch") for n in windows["notes"])
    assert any(n.startswith("the object-store floor / one-thread ceiling") for n in windows["notes"])
    assert any(n.startswith("floor skipped: it has no tokens workload") for n in report["notes"]), report["notes"]
    assert any(n.startswith("raydl / Ray Data in the later epochs: ") for n in report["notes"]), report["notes"]
    assert windows["unit"] == "windows" and report["unit"] == "rows"
    assert any(note.startswith("rows/s is 2048-token rows per second") for note in report["notes"])


@pytest.mark.timeout(300)
def test_bench_runs_raydl_against_a_running_cluster_and_stops_it(tmp_path):
    """--running-cluster: a head started by the bench on 127.0.0.1, raydl in a fresh process that connects to it
    (every image delivered, its start-up split and noted), and the head's processes gone at the end (by PID)."""
    import psutil

    data = _tiny_folder(tmp_path / "data", n=16)
    out = tmp_path / "bench.json"
    args = _parse(["--data", str(data), "--compare", "", "--no-ceiling", "--rounds", "1", "--cpus", "1",
                   "--running-cluster", "--batch-size", "8", "--json", str(out)])
    assert loader.main(args) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["peer"] == "raydl" and run["ok"] and run["images"] == 16, run
    assert 0 < run["ray_init_s"] < run["first_batch_from_start_s"]
    assert any("connecting to the running cluster" in note for note in report["notes"]), report["notes"]
    assert "raylet" in run["peak_pss_by_process_mib"], run  # the cluster's processes are sampled with the run's
    try:
        head = psutil.Process(args.cluster_pid)
        assert head.status() == psutil.STATUS_ZOMBIE, head
    except psutil.NoSuchProcess:
        pass


def test_the_rounds_balance_each_peers_place_and_neighbours():
    """Over a cycle of rounds (n for an even number n of peers, 2n for an odd one) every peer runs once in
    each place, and right after every other peer equally often; every round runs each peer once."""
    for n in range(1, 8):
        peers = [f"p{k}" for k in range(n)]
        cycle = n if n % 2 == 0 or n < 3 else 2 * n
        orders = [loader.round_order(peers, i) for i in range(1, cycle + 1)]
        assert all(sorted(o) == peers for o in orders)
        assert orders[0] == loader.round_order(peers, cycle + 1)  # the cycle repeats
        for place in range(n):
            firsts = [o[place] for o in orders]
            assert all(firsts.count(p) == cycle // n for p in peers), (n, place, orders)
        if n >= 2:
            pairs = [(o[k], o[k + 1]) for o in orders for k in range(n - 1)]
            counts = {(a, b): pairs.count((a, b)) for a in peers for b in peers if a != b}
            assert len(set(counts.values())) == 1, (n, counts)
    assert loader.round_order(["raydl", "dataio"], 2) == ["dataio", "raydl"]
    assert loader.round_order([], 2) == []
