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


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run by tests:"  # first line of a bash block that cannot run here, then the reason
RUN_BY_JOB_TEST = "ray job submit"  # README's job block: tests/ray/test_job.py runs it against its own head


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def _python_blocks(path: Path) -> list[str]:
    return _blocks(path, "python")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in DOCS])
def test_python_blocks_run(doc, tmp_path):
    """Every ```python block in README.md and docs/*.md runs to completion in a fresh interpreter."""
    blocks = _python_blocks(ROOT / doc)
    env = dict(os.environ, RAYDL_CHECKPOINT_BIND="127.0.0.1:0",  # checkpoint publishers: loopback only
               RAYDL_DEMO_DIR=str(tmp_path / "demo"))
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=280,
                              env=env)
        assert proc.returncode == 0, f"{doc} block failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(30)
def test_readme_has_python_blocks_and_every_bash_block_runs_somewhere():
    """README has python blocks; every ```bash block is README's job block (run by tests/ray/test_job.py), runs in
    test_bash_blocks_run, or says on its first line why no test can run it."""
    assert _python_blocks(ROOT / "README.md"), "README.md has no python blocks"
    job_blocks = [b for d in DOCS for b in _blocks(d, "bash") if RUN_BY_JOB_TEST in b]
    assert len(job_blocks) == 1 and job_blocks[0] in _blocks(ROOT / "README.md", "bash")
    for doc in DOCS:
        for block in _blocks(doc, "bash"):
            if block.startswith(NOT_RUN):
                assert len(block.splitlines()[0]) > len(NOT_RUN) + 10, f"{doc}: give the reason:\n{block}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in DOCS])
def test_bash_blocks_run(doc, tmp_path):
    """Every ```bash block of README.md and docs/*.md that can run here runs, from the repository root."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               RAYDL_CHECKPOINT_BIND="127.0.0.1:0", RAYDL_DEMO_DIR=str(tmp_path / "demo"))
    for block in _blocks(ROOT / doc, "bash"):
        if block.startswith(NOT_RUN) or RUN_BY_JOB_TEST in block:
            continue
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, capture_output=True, text=True,
                              timeout=580, env=env)
        assert proc.returncode == 0, f"{doc} block failed:\n{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in DOCS])
def test_yaml_blocks_load(doc, tmp_path):
    """Every ```yaml block in the docs that is a config (has `source:`) loads; the others parse."""
    import yaml

    for i, block in enumerate(_blocks(ROOT / doc, "yaml")):
        data = yaml.safe_load(block)
        if isinstance(data, dict) and "source" in data:
            path = tmp_path / f"block{i}.yaml"
            path.write_text(block)
            assert isinstance(load_config(path), Config)


@pytest.mark.timeout(30)
def test_kuberay_manifest_runs_the_job_with_a_config_that_loads():
    """examples/kuberay-rayjob.yaml is a RayJob running examples/train.py with a config that exists and loads with
    its --set overrides, with token authentication on in every Ray container and the submitter."""
    import shlex

    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "kuberay-rayjob.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["python", "examples/train.py"]
    config = argv[argv.index("--config") + 1]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert (ROOT / config).is_file(), f"the manifest names {config}, which does not exist"
    assert isinstance(load_config(ROOT / config, sets), Config)
    spec = doc["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"]),
            doc["spec"]["submitterPodTemplate"]]
    for pod in pods:
        for c in pod["spec"]["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token" and "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]


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
    ("loader: {batch_size: 8}\nval: {source: {kind: webdataset, urls: s3://b/x.tar, s3: {endpoint: x}}}",
     "val.source.s3.endpoint"),
])
def test_config_rejects_unknown_keys(tmp_path, bad, named):
    """A YAML key that is not a field (or a stage, or a section) is an error naming the key and the file."""
    path = tmp_path / "bad.yaml"
    path.write_text("source: {kind: images, path: /x}\n" + bad + "\n")
    with pytest.raises(ValueError, match=re.escape(named)) as err:
        load_config(path)
    assert str(path) in str(err.value)


@pytest.mark.timeout(30)
def test_config_sources_map_to_the_read_functions(tmp_path):
    """source.kind picks read_images / read_webdataset / read_parquet; `s3:` becomes a raydl.S3Options."""
    from raydl.config import ParquetSource, S3Options, WebDatasetSource

    path = tmp_path / "c.yaml"
    path.write_text("source: {kind: parquet, paths: [s3://b/t.parquet], image_column: jpg, s3: {region: eu-west-1}}\n"
                    "loader: {batch_size: 8}\n")
    cfg = load_config(path)
    assert cfg.source == ParquetSource(paths=("s3://b/t.parquet",), image_column="jpg",
                                       s3=S3Options(region="eu-west-1"))
    wds = load_config(ROOT / "configs" / "webdataset-s3.yaml").source
    assert isinstance(wds, WebDatasetSource) and wds.s3.max_concurrency == 64
    with pytest.raises(ValueError, match="source.image_column"):
        path.write_text("source: {kind: parquet, paths: x.parquet}\nloader: {batch_size: 8}\n")
        load_config(path)


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
