"""examples/llm_pretrain.py killed mid-run and started again: each rank goes on from the last Ray Train
checkpoint with exactly the windows a run never interrupted trains on."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, CRASH, WORKERS, BATCH, SEQ = 40, 10, 25, 2, 8, 32


def _example():
    spec = importlib.util.spec_from_file_location("llm_pretrain", ROOT / "examples" / "llm_pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uninterrupted(example, corpora: dict[str, str]) -> list[list[list]]:
    """Each rank's windows ([source, id] per row) for steps 1..STEPS, taken straight from the loader the
    example builds, epoch after epoch."""
    ds = example.dataset(corpora, example.DEMO_WEIGHTS, seq_len=SEQ, eod=example.DEMO_EOD)
    per_rank = []
    with example.make_loader(ds, batch_size=BATCH, workers=WORKERS) as loader:
        for rank in range(WORKERS):
            it, steps = loader.iterator(rank), []
            while len(steps) < STEPS:
                for batch in it.iter_batches():
                    steps.append([[str(s), int(i)] for s, i in zip(batch["source"], batch["id"], strict=True)])
                    if len(steps) == STEPS:
                        break
            per_rank.append(steps)
    return per_rank


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """The example in its own process group; whatever of it outlives the run (a killed driver's Ray
    helpers) is killed with the group."""
    args = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--workers", str(WORKERS),
            "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--documents", "60",
            "--checkpoint-dir", str(tmp_path / "run"), "--log-windows", str(tmp_path / "windows"), *extra]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "examples/llm_pretrain.py", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=250)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(600)
def test_a_killed_run_resumes_on_the_exact_next_window(tmp_path):
    """Killed (SIGKILL of the driver) at step 25 after checkpoints at 10 and 20, then started again with
    the same checkpoint folder: the second run trains steps 21..40, and every step of both runs, on every
    rank, consumed the windows of an uninterrupted run's same step."""
    example = _example()
    corpora = example.write_demo_corpora(str(tmp_path / "run" / "corpora"), 60)  # the example reads these
    # A local Ray of the test's own for the reference, gone before the example starts its own.
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        expected = _uninterrupted(example, corpora)
    finally:
        ray.shutdown()

    killed = _run(tmp_path, "--crash-at-step", str(CRASH))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "mean loss every" in resumed.stdout, resumed.stdout

    resume_step = CRASH // EVERY * EVERY
    for rank in range(WORKERS):
        lines = [json.loads(ln) for ln in (tmp_path / "windows" / f"rank{rank}.jsonl").read_text().splitlines()]
        steps = [ln["step"] for ln in lines]
        assert steps == [*range(1, CRASH + 1), *range(resume_step + 1, STEPS + 1)], (rank, steps)
        for ln in lines:
            assert ln["windows"] == expected[rank][ln["step"] - 1], (rank, ln["step"])
    assert expected[0] != expected[1]  # the ranks' windows differ, so a rank reading another's state fails
