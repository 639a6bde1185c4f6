"""The docs do not lie: README code blocks, examples/ and configs/ all run or load."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.config import Config, LoaderConfig, load_config

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


def _example_args(name: str, tmp: Path) -> list[str]:
    """Small sizes for the examples that take a config: data and state under the test's own folder."""
    if name == "train.py":
        return ["--set", f"source.path={tmp}/train", "--set", f"val.source.path={tmp}/val",
                "--set", f"job.state_dir={tmp}/state", "--set", "job.epochs=1", "--set", "job.steps_per_epoch=1"]
    return []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_run(example, tmp_path):
    """Each file in examples/ runs with its small defaults."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example), *_example_args(example, tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{example} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_configs_load(config):
    """Each YAML in configs/ loads into the frozen config dataclasses, its pipeline stages known to Dataset."""
    cfg = load_config(ROOT / "configs" / config)
    assert isinstance(cfg, Config) and isinstance(cfg.loader, LoaderConfig)
    assert cfg.pipeline.stages, f"{config} has no pipeline"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, named", [
    ("loader: {batch_size: 8, batchsize: 9}", "loader.batchsize"),
    ("loader: {batch_size: 8}\njobs: {}", "jobs"),
    ("loader: {batch_size: 8}\npipeline: [decode, {random_resized_crop: {sise: 3}}]", "random_resized_crop.sise"),
    ("loader: {batch_size: 8}\npipeline: [decode, blur]", "blur"),
    ("loader: {batch_size: 8}\njob: {workers: 2, epoch: 3}", "job.epoch"),
    ("loader: {batch_size: 8}\nval: {source: {path: /x, lables: folder}}", "val.source.lables"),
])
def test_config_rejects_unknown_keys(tmp_path, bad, named):
    """A YAML key that is not a field (or a stage, or a section) is an error naming the key and the file."""
    path = tmp_path / "bad.yaml"
    path.write_text("source: {kind: images, path: /x}\n" + bad + "\n")
    with pytest.raises(ValueError, match=re.escape(named)) as err:
        load_config(path)
    assert str(path) in str(err.value)


@pytest.mark.timeout(30)
def test_config_set_overrides_single_values():
    """--set section.key=value overrides one value (typed as YAML), pipeline stages by name; typos are errors."""
    cfg = load_config(ROOT / "configs" / "local-demo.yaml",
                      ["loader.batch_size=128", "pipeline.random_resized_crop.size=32", "job.epochs=3",
                       "val.loader.batch_size=7", "loader.object_store_budget=null"])
    assert (cfg.loader.batch_size, cfg.job.epochs, cfg.val.loader.batch_size) == (128, 3, 7)
    assert dict(cfg.pipeline.stages[1].kwargs) == {"size": 32}
    assert cfg.loader.world_size == cfg.job.workers == 2 and cfg.val.loader.shuffle is False
    with pytest.raises(ValueError, match=r"--set loader\.batchsize"):
        load_config(ROOT / "configs" / "local-demo.yaml", ["loader.batchsize=3"])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        load_config(ROOT / "configs" / "local-demo.yaml", ["loader.batch_size=0"])
