"""examples/train.py on a config mistake: the message, on one line, and exit status 2, never a traceback; an epoch
that would deliver nothing is such a mistake, found when the loader is built rather than scored as accuracy 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path, *sets: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAYDL_DEMO_DIR=str(tmp_path / "demo"), RAYDL_CHECKPOINT_BIND="127.0.0.1:0")
    env.pop("RAY_ADDRESS", None)
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "examples/train.py", "--fresh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(120)
def test_a_bad_value_prints_the_message_without_a_traceback(tmp_path):
    """--set loader.batch_size=0: one line naming the file and the key, exit status 2."""
    r = _train(tmp_path, "loader.batch_size=0")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().endswith(
        "raydl-train: error: configs/local-demo.yaml: `loader`: batch_size must be a positive int, got 0"
    ), r.stderr[-3000:]


@pytest.mark.timeout(450)
def test_a_validation_epoch_with_no_batch_is_a_config_mistake(tmp_path):
    """drop_last=true with batch_size 128: the 64 validation samples make no batch, which the script says (which
    loader, why, what to change) instead of training and printing "accuracy 0.000 on 0 validation samples"."""
    r = _train(tmp_path, "loader.drop_last=true", "loader.batch_size=128")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in r.stderr and "0 validation samples" not in out, out[-3000:]
    assert ("raydl-train: error: the validation loader (`val.loader:`, which takes `loader:`'s values it does not "
            "set): an epoch of this loader would deliver no batch: with drop_last=True a round of batches needs "
            "batch_size 128 x world_size 1 = 128, and the data has 64 samples; lower batch_size to at most 64, or set "
            "drop_last=False") in r.stderr, r.stderr[-3000:]


def _readme_block(marker: str) -> str:
    import re

    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S) if marker in b]
    assert len(blocks) == 1, f"README.md should have one python block with {marker}"
    return blocks[0]


@pytest.mark.timeout(400)
def test_the_readme_ray_train_block_says_what_it_does_and_how_it_learns():
    """README's Ray Train block (workers' logs off) prints what it starts before the slow start-up, then each
    epoch's loss, falling."""
    import re

    r = subprocess.run([sys.executable, "-c", _readme_block("TorchTrainer")], cwd=ROOT, capture_output=True,
                       text=True, timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines and lines[0].startswith("Ray Train: 2 workers, 3 epochs of 64 images"), r.stdout
    losses = [float(m.group(2)) for m in (re.fullmatch(r"epoch (\d): loss ([\d.]+)", ln) for ln in lines[1:]) if m]
    assert len(losses) == 3 and losses[-1] < losses[0] < 1.5, r.stdout
