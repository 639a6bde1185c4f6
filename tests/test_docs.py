"""The docs do not lie: README code blocks, examples/ and configs/ all run or load."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.config import LoaderConfig, load_loader_config

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.timeout(300)
def test_readme_python_blocks_run():
    """Every ```python block in README.md runs to completion in a fresh interpreter."""
    blocks = _python_blocks(ROOT / "README.md")
    assert blocks, "README.md has no python blocks"
    env = dict(os.environ, RAYDL_CHECKPOINT_BIND="127.0.0.1:0")  # checkpoint publishers: loopback only
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=280,
                              env=env)
        assert proc.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_run(example):
    """Each file in examples/ runs with its small defaults."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{example} failed:\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_configs_load(config):
    """Each YAML in configs/ is a valid LoaderConfig."""
    assert isinstance(load_loader_config(str(ROOT / "configs" / config)), LoaderConfig)


@pytest.mark.timeout(30)
def test_config_rejects_unknown_keys(tmp_path):
    """A YAML key that is not a LoaderConfig field is an error naming it."""
    path = tmp_path / "bad.yaml"
    path.write_text("batch_size: 8\nbatchsize: 9\n")
    with pytest.raises(ValueError, match="batchsize"):
        load_loader_config(str(path))
