"""The fuzzing suite: every target in tests/fuzz/targets runs for RAYDL_FUZZ_SECONDS (default 20), with
RAYDL_FUZZ_SEED (default 0; scripts/test.sh draws a fresh one each run and prints it), and must reach its
floor (MIN_INPUTS inputs, MIN_ACCEPTED of them past every check) or fail.

Each target runs in a child process (tests/fuzz/harness.py), so a crash, a hang or an allocation
past the harness's limit is a failed test with the input that caused it, not a dead pytest. The
harness's own tests below plant each kind of defect and check that it is found.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.py"
TARGETS = sorted(p for p in (HERE / "targets").glob("*.py") if not p.name.startswith("_"))
SECONDS = float(os.environ.get("RAYDL_FUZZ_SECONDS", "20"))
SEED = os.environ.get("RAYDL_FUZZ_SEED", "0")


def _run(target: Path, out: Path, seconds: float, timeout_s: float, **env: str):
    cmd = [sys.executable, str(HARNESS), str(target), "--seconds", str(seconds), "--seed", SEED, "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "MALLOC_ARENA_MAX": "2", **env})


def test_targets_exist():
    names = {p.stem for p in TARGETS}
    assert {"jpeg_region", "resample", "tar_index", "wds_grouping", "parquet_listing"} <= names, names


@pytest.mark.parametrize("target", TARGETS, ids=[p.stem for p in TARGETS])
@pytest.mark.timeout(SECONDS * 3 + 240)
def test_fuzz_target(target: Path, tmp_path: Path):
    proc = _run(target, tmp_path, SECONDS, timeout_s=SECONDS * 3 + 200)
    current = tmp_path / "current.bin"
    last = current.read_bytes()[:512] if current.exists() else b""
    assert proc.returncode == 0, (
        f"fuzz target {target.stem} found a defect or ran below its floor (rc {proc.returncode}; "
        f"RAYDL_FUZZ_SEED={SEED} replays it); last input (first 512 bytes): {last!r}\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}")
    assert "no finding" in proc.stdout, proc.stdout
    print(proc.stdout.strip())  # the counts, and the seed, under pytest -s or -rA


@pytest.mark.parametrize("plant, evidence", [
    ("raise", "KeyError: 'planted'"),
    ("crash", "Fatal Python error: Segmentation fault"),
    ("hang", "Timeout (0:00:01)!"),
    ("allocate", "MemoryError"),
])
@pytest.mark.timeout(120)
def test_harness_finds_planted_defects(plant: str, evidence: str, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(HERE / "selftest" / "finds.py"), "--seconds", "20", "--per-input-s", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=100, env={**os.environ, "FUZZ_PLANT": plant, "MALLOC_ARENA_MAX": "2"})
    assert proc.returncode != 0, proc.stdout
    assert evidence in proc.stderr, proc.stderr[-4000:]
    assert b"\x42" in (tmp_path / "current.bin").read_bytes()


@pytest.mark.parametrize("plant", ["refuse", "crawl"])
@pytest.mark.timeout(120)
def test_harness_fails_a_target_below_its_floor(plant: str, tmp_path: Path):
    """A target that rejects every input, or one too slow to reach MIN_INPUTS, fails the run, giving its
    counts, floor and seed: it is not "no finding"."""
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(HERE / "selftest" / "finds.py"), "--seconds", "2", "--max-seconds", "4",
         "--seed", "7", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=100, env={**os.environ, "FUZZ_PLANT": plant})
    assert proc.returncode == 3, proc.stdout + proc.stderr[-4000:]
    assert "BELOW ITS FLOOR" in proc.stderr and "floor 200 and 20" in proc.stderr and "seed 7" in proc.stderr
    assert "no finding" not in proc.stdout


@pytest.mark.timeout(120)
def test_harness_passes_a_clean_target(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(HERE / "selftest" / "finds.py"), "--seconds", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=100, env={**os.environ, "FUZZ_PLANT": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rejected with an allowed error" in proc.stdout and "no finding" in proc.stdout, proc.stdout
