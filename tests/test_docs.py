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
# README's Ray Train block: tests/ray/test_train_example.py runs it and checks what it prints (one run, not two)
RUN_BY_TRAIN_TEST = "TorchTrainer"
# examples run end to end by a test of their own, with more checks than "it runs"
EXAMPLES_RUN_ELSEWHERE = {"llm_pretrain.py": "tests/ray/test_llm_pretrain_example.py"}


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def _python_blocks(path: Path) -> list[str]:
    return _blocks(path, "python")


def _bash_blocks_to_run(path: Path) -> list[str]:
    return [b for b in _blocks(path, "bash") if not b.startswith(NOT_RUN) and RUN_BY_JOB_TEST not in b]


# How many blocks of each kind each doc holds ("bash run": its bash blocks that run here). The tests below
# run the docs named here and check these counts, so none of them passes having found nothing to run (a
# renamed fence, a moved doc); a doc not named holds none, which test_block_counts_are_as_stated checks.
BLOCKS = {
    "README.md": {"python": 6, "bash": 2, "bash run": 1},
    "docs/benchmarks.md": {"bash": 19},
    "docs/cluster.md": {"bash": 1},
    "docs/configs.md": {"python": 1, "bash": 1, "bash run": 1, "yaml": 2},
    "docs/data.md": {"python": 6, "bash": 1},
    "docs/errors.md": {"python": 1},
}


def _docs_with(kind: str) -> list[str]:
    return [doc for doc, counts in BLOCKS.items() if counts.get(kind)]


@pytest.mark.timeout(30)
def test_block_counts_are_as_stated():
    """Every doc holds exactly the python, bash and yaml blocks BLOCKS says (none where it names no doc)."""
    assert set(BLOCKS) <= {p.relative_to(ROOT).as_posix() for p in DOCS}
    for path in DOCS:
        doc = path.relative_to(ROOT).as_posix()
        found = {"python": len(_python_blocks(path)), "bash": len(_blocks(path, "bash")),
                 "bash run": len(_bash_blocks_to_run(path)), "yaml": len(_blocks(path, "yaml"))}
        stated = {kind: BLOCKS.get(doc, {}).get(kind, 0) for kind in found}
        assert found == stated, f"{doc}: update BLOCKS in tests/test_docs.py"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", _docs_with("python"))
def test_python_blocks_run(doc, tmp_path):
    """Every ```python block in README.md and docs/*.md runs to completion in a fresh interpreter."""
    blocks = _python_blocks(ROOT / doc)
    assert len(blocks) == BLOCKS[doc]["python"]
    if doc == "README.md":
        blocks = [b for b in blocks if RUN_BY_TRAIN_TEST not in b]
        assert len(blocks) == BLOCKS[doc]["python"] - 1
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
    train_blocks = [b for b in _python_blocks(ROOT / "README.md") if RUN_BY_TRAIN_TEST in b]
    assert len(train_blocks) == 1 and "_readme_block(\"TorchTrainer\")" in (
        ROOT / "tests" / "ray" / "test_train_example.py").read_text()
    for example, test in EXAMPLES_RUN_ELSEWHERE.items():
        assert (ROOT / "examples" / example).exists() and f"examples/{example}" in (ROOT / test).read_text()
    for doc in DOCS:
        for block in _blocks(doc, "bash"):
            if block.startswith(NOT_RUN):
                assert len(block.splitlines()[0]) > len(NOT_RUN) + 10, f"{doc}: give the reason:\n{block}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", _docs_with("bash run"))
def test_bash_blocks_run(doc, tmp_path):
    """Every ```bash block of README.md and docs/*.md that can run here runs, from the repository root."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               RAYDL_CHECKPOINT_BIND="127.0.0.1:0", RAYDL_DEMO_DIR=str(tmp_path / "demo"))
    blocks = _bash_blocks_to_run(ROOT / doc)
    assert len(blocks) == BLOCKS[doc]["bash run"]
    for block in blocks:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, capture_output=True, text=True,
                              timeout=580, env=env)
        assert proc.returncode == 0, f"{doc} block failed:\n{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("doc", _docs_with("yaml"))
def test_yaml_blocks_load(doc, tmp_path):
    """Every ```yaml block in the docs that is a config (has `source:`) loads; the others parse."""
    import yaml

    blocks = _blocks(ROOT / doc, "yaml")
    assert len(blocks) == BLOCKS[doc]["yaml"]
    for i, block in enumerate(blocks):
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
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")
                                            if p.name not in EXAMPLES_RUN_ELSEWHERE))
def test_examples_run(example, tmp_path):
    """Each file in examples/ runs with its small defaults (those in EXAMPLES_RUN_ELSEWHERE in their own test)."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example), *_example_args(example, tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{example} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"



@pytest.mark.timeout(120)
def test_train_example_says_where_its_state_is_and_how_to_start_afresh(tmp_path):
    """examples/train.py over a finished run says so, naming the state folder and --fresh, without starting Ray;
    --fresh forgets only what the script wrote there."""
    import importlib.util
    import json

    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text(json.dumps({"epoch": 2, "model": "model-1.pt", "iterators": []}))
    (state / "model-1.pt").write_bytes(b"weights")
    (state / "notes.txt").write_text("not the script's")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), *_example_args("train.py", tmp_path),
                           "--set", "job.epochs=2"], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"all 2 epochs in {state} are done; nothing to do (--fresh starts afresh" in proc.stdout, proc.stdout
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    train.forget_state(str(state))
    assert sorted(p.name for p in state.iterdir()) == ["notes.txt"]

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
    path.write_text("source: {kind: webdataset, urls: a.tar, fields: {image: 'jpg;png', caption: txt}}\n"
                    "loader: {batch_size: 8}\n")
    assert load_config(path).source.fields == {"image": "jpg;png", "caption": "txt"}
    wds = load_config(ROOT / "configs" / "webdataset-s3.yaml").source
    assert isinstance(wds, WebDatasetSource) and wds.s3.max_concurrency == 64
    path.write_text("source: {kind: parquet, paths: x.parquet, columns: [input_ids]}\nloader: {batch_size: 8}\n")
    assert load_config(path).source == ParquetSource(paths="x.parquet", columns=("input_ids",))  # no image needed
    with pytest.raises(ValueError, match="source.colums"):
        path.write_text("source: {kind: parquet, paths: x.parquet, colums: [a]}\nloader: {batch_size: 8}\n")
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



@pytest.mark.timeout(30)
def test_config_loader_cache_is_a_raydl_cache(tmp_path):
    """`loader.cache: {path, max_bytes}` becomes a raydl.Cache (val.loader inherits it); a bad one names the key."""
    import raydl

    path = tmp_path / "c.yaml"
    path.write_text("source: {kind: images, path: /x}\nloader: {batch_size: 8, cache: {path: /c, max_bytes: 1024}}\n"
                    "val: {source: {kind: images, path: /y}}\n")
    cfg = load_config(path)
    assert cfg.loader.cache == raydl.Cache("/c", max_bytes=1024) and cfg.val.loader.cache == cfg.loader.cache
    assert load_config(path, ["loader.cache=null"]).loader.cache is None
    path.write_text("source: {kind: images, path: /x}\nloader: {batch_size: 8, cache: {path: /c, max_byte: 1}}\n")
    with pytest.raises(ValueError, match=r"loader\.cache\.max_byte"):
        load_config(path)


@pytest.mark.timeout(30)
def test_demo_config_keeps_its_state_in_a_folder_of_the_users_own(tmp_path, monkeypatch):
    """configs/local-demo.yaml's data and state: $RAYDL_DEMO_DIR, else $XDG_CACHE_HOME/raydl/local-demo, else
    ~/.cache/raydl/local-demo (a `${VAR:-default}` default may name variables itself), never a shared /tmp path."""
    monkeypatch.delenv("RAYDL_DEMO_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(ROOT / "configs" / "local-demo.yaml")
    assert cfg.job.state_dir == f"{tmp_path}/home/.cache/raydl/local-demo/state"
    assert cfg.source.path == f"{tmp_path}/home/.cache/raydl/local-demo/train"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert load_config(ROOT / "configs" / "local-demo.yaml").job.state_dir == f"{tmp_path}/xdg/raydl/local-demo/state"
    monkeypatch.setenv("RAYDL_DEMO_DIR", str(tmp_path / "demo"))
    monkeypatch.delenv("HOME")  # a default that is not needed is not read
    assert load_config(ROOT / "configs" / "local-demo.yaml").job.state_dir == f"{tmp_path}/demo/state"

# ------------------------------------------------- docs/errors.md against the real messages ----

ERRORS_MD = ROOT / "docs" / "errors.md"
_SPAN = re.compile(r"``(.+?)``|`([^`]+)`")


def _documented_errors() -> list[str]:
    """The messages errors.md quotes: code spans holding ': ' in the first cell of a table row (`…` stands
    for any text); rows about Ray's own messages ("Ray's ...") are Ray's to word."""
    found = []
    for line in ERRORS_MD.read_text().splitlines():
        cell = line[2:].split(" | ")[0] if line.startswith("| ") else ""
        if cell and cell != "you see" and not cell.startswith("Ray's"):
            found += [text for a, b in _SPAN.findall(cell) if ": " in (text := a or b)]
    return found


def _as_regex(documented: str) -> re.Pattern:
    return re.compile(".*?".join(re.escape(part) for part in documented.split("…")), re.S)


def _raised(call) -> str:
    """`ExceptionName: message` of what call() raises."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - any error is the one to compare
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{call} raised nothing")


def _raise(exc: Exception):
    raise exc


def _error_triggers(tmp: Path) -> dict[str, list]:
    """Each documented message that one process can trigger without Ray, and the calls that raise it (the
    loader's sample errors from the error policy that builds them, as the worker and the iterator do)."""
    import io
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    import raydl
    from raydl import checkpoint
    from raydl.storage.local import LocalStorage

    (tmp / "empty").mkdir()
    (tmp / "loose" / "c0").mkdir(parents=True)
    for path in (tmp / "loose" / "a.jpg", tmp / "loose" / "c0" / "b.jpg"):
        path.write_bytes(b"not decoded at listing")
    (tmp / "junk.tar").write_bytes(bytes(range(256)) * 4)
    member = io.BytesIO()
    with tarfile.open(fileobj=member, mode="w") as tar:
        info = tarfile.TarInfo("a.jpg")
        info.size = 3000
        tar.addfile(info, io.BytesIO(b"x" * 3000))
    (tmp / "cut.tar").write_bytes(member.getvalue()[:2000])
    (tmp / "junk.parquet").write_bytes(b"not a parquet file")
    (tmp / "footer.parquet").write_bytes(b"PAR1" + bytes(20) + (10**6).to_bytes(4, "little") + b"PAR1")
    pq.write_table(pa.table({"img": [b"x"]}), tmp / "ok.parquet")
    ds = raydl.read_images(str(tmp / "loose"), labels=None)

    def config(text: str, sets=()):
        path = tmp / f"bad{len(list(tmp.glob('bad*.yaml')))}.yaml"
        path.write_text("source: {kind: images, path: /x}\n" + text + "\n")
        return lambda: load_config(path, list(sets))

    missing = str(tmp / "missing.jpg")
    from raydl.errors import DataSourceError
    from raydl.plan.failures import ErrorPolicy, Failure  # the one policy the worker and the iterator ask

    bad = Failure(3, "/data/c0/x.jpg", "corrupt JPEG")
    from raydl.errors import MissingFieldError

    lacking = Failure.source_failed(3, "/d/s.tar", "/d/s.tar#k3", MissingFieldError(
        "/d/s.tar: sample 'k3' lacks the field 'caption' (no .txt member)", uri="/d/s.tar"))
    gone = Failure.read_failed(3, "/data/c0/x.jpg", DataSourceError("cannot read '/data/c0/x.jpg'", uri=""))
    return {
        "DataSourceError: rank …: batch … of epoch …: cannot read sample … (…): …": [
            lambda: ErrorPolicy("skip").settle([gone], rank=1, epoch=0, batch=7)],
        "SampleDecodeError: rank …: cannot decode sample … (…): …": [
            lambda: ErrorPolicy("raise").settle([bad], rank=1, epoch=0, batch=7)],
        "MissingFieldError: rank …: batch … of epoch …: incomplete sample … (…): …": [
            lambda: ErrorPolicy("raise").settle([lacking], rank=1, epoch=0, batch=7)],
        "SampleDecodeError: cannot bucket sample … (…): …": [
            lambda: ErrorPolicy("raise").settle([Failure.unsized(3, "/data/c0/x.jpg", "no SOF marker")])],
        "SampleDecodeError: …sample … (…) failed (…) and none of its substitutes … could be decoded either; is most "
        "of the data bad?": [lambda: _raise(ErrorPolicy("replace").no_substitute(bad, [5, 9]))],
        "LoaderError: loader worker …: sample … (…) failed with …: … (not a decode error: on_error does not cover "
        "it)": [lambda: Failure.decode_failed(3, "/data/c0/x.jpg", MemoryError("no room"), worker="host:123")],
        "DataSourceError: '…' does not exist": [lambda: raydl.read_images(str(tmp / "no-such-folder")),
                                                lambda: raydl.read_webdataset(str(tmp / "no-such.tar")),
                                                lambda: raydl.read_parquet(str(tmp / "no-such-folder"))],
        "ValueError: the Parquet path '…' matches nothing (no *.parquet files below it)": [
            lambda: raydl.read_parquet(str(tmp / "empty"))],
        "DataSourceError: no images (.jpg, .jpeg, .png, .webp, .bmp) found under '…'": [
            lambda: raydl.read_images(str(tmp / "empty")), lambda: raydl.read_images(str(ROOT / "README.md"))],
        "DataSourceError: '…' (and … more) lie directly in the root, so they have no class folder; move them into "
        "a class folder or pass labels=None": [lambda: raydl.read_images(str(tmp / "loose"))],
        "DataSourceError: cannot stat '…': …": [lambda: LocalStorage().stat(missing)],
        "DataSourceError: cannot read '…' at offset …: …": [lambda: LocalStorage().read_range(missing, 0, 1)],
        "DataSourceError: …: corrupt tar header at offset … (…); the shard is damaged": [
            lambda: raydl.read_webdataset(str(tmp / "junk.tar"))],
        "DataSourceError: …: truncated tar shard: …": [lambda: raydl.read_webdataset(str(tmp / "cut.tar"))],
        **_hostile_shard_triggers(tmp),
        **_record_triggers(tmp),
        **_cache_triggers(tmp),
        **_batch_format_triggers(),
        **_mix_triggers(tmp),
        **_tokens_triggers(tmp),
        "DataSourceError: … is not a Parquet file (…)": [
            lambda: raydl.read_parquet(str(tmp / "junk.parquet"), image_column="img")],
        "DataSourceError: …: corrupt Parquet footer (…)": [
            lambda: raydl.read_parquet(str(tmp / "footer.parquet"), image_column="img")],
        "ValueError: the shard pattern '…' matches nothing": [
            lambda: raydl.read_webdataset(str(tmp / "none-*.tar")),
            lambda: raydl.read_webdataset(str(tmp / "x-{000..}.tar"))],
        "ValueError: unsupported URL scheme '…' in '…'; raydl reads file, s3, gs, az (local paths need no scheme)": [
            lambda: raydl.read_images("hdfs://bucket/train")],
        "ValueError: … has no column '…'; its columns are […]": [
            lambda: raydl.read_parquet(str(tmp / "ok.parquet"), image_column="image")],
        "ValueError: .… needs .decode() before it: the first stage must be .decode()": [
            lambda: ds.center_crop(8), lambda: ds.normalize()],
        "ValueError: .normalize() must be the last stage, but .… follows it (…)": [
            lambda: ds.decode().normalize().random_hflip()],
        "ValueError: .… cannot join this pipeline: .aspect_buckets() replaces the crop/resize stages: …": [
            lambda: ds.decode().center_crop(8).aspect_buckets(64)],
        "ValueError: …: unknown key `…`; `…` takes […]": [config("loader: {batch_size: 8, batchsize: 9}")],
        "ValueError: … (--set …): unknown key `…`; …": [config("loader: {batch_size: 8}", ["loader.batchsize=3"])],
        "ValueError: …: unknown stage `pipeline[…].…`; stages are […]": [
            config("loader: {batch_size: 8}\npipeline: [decode, blur]")],
        "ValueError: …: `loader`: batch_size must be a positive int, got …": [config("loader: {batch_size: 0}")],
        "ValueError: …: ${…} is not set (write ${…:-default} for a default)": [
            config("loader: {batch_size: 8}\njob:\n  state_dir: ${RAYDL_DOCS_TEST_UNSET}")],
        "ValueError: …: not valid YAML: …": [config("loader: {batch_size: 8")],
        "CheckpointError: cannot publish checkpoint path '…': not a regular file": [
            lambda: checkpoint.publish(str(tmp / "empty"))],
        "ValueError: state must map str to torch.Tensor; '…' maps to …": [lambda: checkpoint.publish({"w": 1})],
    }


def _hostile_shard_triggers(tmp: Path) -> dict[str, list]:
    """The shard errors: a malformed pax record, a gzip bomb, a damaged gzip stream, a label member
    too big to be a label."""
    import gzip
    import io
    import tarfile
    import zlib

    import raydl

    def tar_of(*members, fmt=tarfile.GNU_FORMAT) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for name, data, kind in members:
                info = tarfile.TarInfo(name)
                info.size, info.type = len(data), kind
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    (tmp / "pax.tar").write_bytes(tar_of(("././@PaxHeader", b"abc path=x\n", tarfile.XHDTYPE),
                                         ("a.jpg", b"x", tarfile.REGTYPE)))
    bomb = zlib.compressobj(9, zlib.DEFLATED, 31)
    (tmp / "bomb.tar.gz").write_bytes(b"".join([*(bomb.compress(bytes(1 << 20)) for _ in range(65)), bomb.flush()]))
    (tmp / "damaged.tar.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(200)))
    (tmp / "cut.tar.gz").write_bytes(gzip.compress(tar_of(("a.jpg", bytes(range(256)) * 40, tarfile.REGTYPE)))[:400])
    (tmp / "label.tar").write_bytes(tar_of(("a.jpg", b"x", tarfile.REGTYPE), ("a.cls", b"7" * 5000, tarfile.REGTYPE)))
    read = lambda name: lambda: raydl.read_webdataset(str(tmp / name))  # noqa: E731

    def located_error(name):  # found by the worker's locate, settled under on_error: raised here
        import numpy as np

        cat = raydl.read_webdataset(str(tmp / name)).catalog
        errors = cat.source.locate(cat, np.arange(len(cat))).errors
        if errors:
            raise next(iter(errors.values()))

    return {
        "DataSourceError: …: corrupt pax header at offset … (…)": [read("pax.tar")],
        "DataSourceError: …: the compressed shard inflates to more than … bytes, the limit for a …-byte shard (…): "
        "a gzip bomb, or a shard to store uncompressed": [read("bomb.tar.gz")],
        "DataSourceError: …: corrupt gzip stream…": [read("damaged.tar.gz")],
        "DataSourceError: …: truncated gzip stream: …": [read("cut.tar.gz")],
        "SampleDecodeError: …: sample … has a …-byte … member at offset …, not an integer label (at most … bytes)": [
            lambda: located_error("label.tar")],
    }


@pytest.mark.timeout(120)
def test_documented_errors_are_the_raised_ones(tmp_path):
    """Each message docs/errors.md quotes that can be triggered here without Ray is quoted there and matches the
    text the call really raises (`…` standing for the names and numbers in it)."""
    documented = _documented_errors()
    for message, calls in _error_triggers(tmp_path).items():
        assert message in documented, f"docs/errors.md no longer quotes {message!r}"
        for call in calls:
            got = _raised(call)
            assert _as_regex(message).fullmatch(got), f"docs/errors.md says {message!r}, the code says {got!r}"


def _string_constants(root: Path) -> list[str]:
    """Every string literal (f-strings' fixed parts included) of the .py files under root, docstrings left out."""
    import ast

    strings = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        strings += [node.value for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    return strings


@pytest.mark.timeout(120)
def test_every_documented_error_is_worded_as_in_the_code(tmp_path):
    """Each message docs/errors.md quotes names an exception raydl raises (or a raydl warning), and every fixed
    piece of its wording (between the `…`) is a string the code writes: the docs cannot drift from messages
    that need Ray, S3 or libfabric to trigger."""
    import builtins

    from raydl import errors

    strings = _string_constants(ROOT / "raydl") + _string_constants(ROOT / "examples")
    triggered = _error_triggers(tmp_path)
    for message in _documented_errors():
        kind, _, text = message.partition(": ")
        assert hasattr(errors, kind) or hasattr(builtins, kind) or kind.startswith("raydl"), message
        if message in triggered:
            continue  # compared with the real text above
        for piece in text.split("…"):
            piece = piece.strip(" '\"()[].,;:")
            if len(piece) > 3:
                assert any(piece in s for s in strings), f"docs/errors.md: {piece!r} of {message!r} is not in the code"


def _cache_triggers(tmp: Path) -> dict[str, list]:
    """The node cache's option errors and its unwritable folder on the driver's node."""
    import raydl
    from raydl.actors.launch import check_cache as _check_cache
    from raydl.options import LoaderConfig

    (tmp / "not-a-dir").write_text("x")
    bad = str(tmp / "not-a-dir" / "cache")
    return {
        "LoaderError: the node cache folder '…' is not writable on node … (…): …": [
            lambda: _check_cache(bad, {"n1": 1}, here="n1")],
        "ValueError: Cache.path must be a non-empty str, got …": [lambda: raydl.Cache("", max_bytes=1)],
        "ValueError: Cache.max_bytes must be a positive int, got …": [lambda: raydl.Cache("/x", max_bytes=0)],
        "ValueError: cache must be a raydl.Cache or None, got …": [
            lambda: LoaderConfig(batch_size=1, cache={"path": "/x", "max_bytes": 1})],
    }


def _record_triggers(tmp: Path) -> dict[str, list]:
    """The Python stages' and the batching's errors, from the calls that raise them."""
    import numpy as np

    import raydl
    from raydl.batch.collate import collate
    from raydl.bench.shards import write_parquet
    from raydl.demo import make_images
    from raydl.describe.fields import Field
    from raydl.describe.records import Map, MapBatches, check_pipeline_order
    from raydl.describe.transforms import CenterCrop, Decode

    make_images(str(tmp / "rec"), 4, classes=2, seed=0, corrupt=0)
    rows = raydl.read_parquet(write_parquet(str(tmp / "rec"), str(tmp / "rec-pq")), columns=["label"])
    return {
        "ValueError: .decode() has no image field to decode: the … source's fields are […], none of them an "
        "image; drop .decode() and the image stages": [lambda: rows.decode().center_crop(8).loader(batch_size=2)],
        "ValueError: .pad('…', ...): the source has no field '…'; its fields are […]": [
            lambda: rows.pad("tokens", 8)],
        "ValueError: .… cannot follow .…(): the native stages (decode, crops, normalize) come first, then map, pad "
        "and map_batches": [lambda: check_pipeline_order((Decode(), Map(dict), CenterCrop(8)))],
        "ValueError: .… cannot follow .map_batches(): per-sample stages come first": [
            lambda: check_pipeline_order((MapBatches(dict), Map(dict)))],
        "LoaderError: field '…' has shape … in … and … in …, in one batch: a batch needs one shape per field; make "
        "one with .pad('…', length) or a map": [
            lambda: collate(Field("emb", "array"), [np.zeros(2), np.zeros(3)], lambda r: f"s{r}")],
    }


def _tokens_triggers(tmp: Path) -> dict[str, list]:
    """read_tokens' listing errors: bad Megatron indexes and .bin files, bad columns, bad arguments."""
    import struct

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import raydl

    def megatron(name, *, magic=b"MMIDIDX\x00\x00", version=1, code=4, count=2, pointers=(0, 40), cut=0,
                 lengths=(10, 6)):
        (tmp / f"{name}.bin").write_bytes(bytes(64 - cut))
        (tmp / f"{name}.idx").write_bytes(struct.pack("<9sQBQQ", magic, version, code, count, 3)
                                          + np.array(lengths, np.int32).tobytes()
                                          + np.array(pointers, np.int64).tobytes() + np.arange(3).tobytes())
        return lambda: raydl.read_tokens(str(tmp / name), seq_len=2)

    megatron("ok")
    pq.write_table(pa.table({"t": pa.array([["a"]]), "n": [1]}), tmp / "strings.parquet")
    (tmp / "notes.txt").write_text("x")
    (tmp / "lone.bin").write_bytes(b"")
    tokens = lambda **kw: lambda: raydl.read_tokens(str(tmp / "ok.bin"), **kw)  # noqa: E731
    return {
        "DataSourceError: … is not a Megatron-LM index: no MMIDIDX magic at its start": [
            megatron("magic", magic=b"NOTANIDX\x00")],
        "DataSourceError: …: Megatron-LM index version …; raydl reads version 1": [megatron("v2", version=2)],
        "DataSourceError: …: token dtype code … is not an integer token type (1 uint8, 2 int8, 3 int16, 4 int32, "
        "5 int64, 8 uint16)": [megatron("float", code=7)],
        "DataSourceError: …: the index says … sequences and … documents, which need … bytes, but it has …": [
            megatron("count", count=1 << 60)],
        "DataSourceError: …: sequence … has length …": [megatron("negative", lengths=(10, -6))],
        "DataSourceError: …: sequence …'s pointer … is past the end of … (… bytes)": [
            megatron("past", pointers=(0, 1 << 40))],
        "DataSourceError: …: sequence … starts at byte … of …, not at … where the one before it ends; raydl reads "
        "sequences laid end to end (as Megatron writes)": [megatron("gap", pointers=(0, 8))],
        "DataSourceError: … is … bytes, shorter than the … bytes its index … gives its … sequences": [
            megatron("short", cut=4)],
        "ValueError: …: column '…' is …, not a list of integers (one document a row)": [
            lambda: raydl.read_tokens(str(tmp / "strings.parquet"), seq_len=1, column="t")],
        "DataSourceError: … holds … tokens in all, fewer than a window of seq_len + 1 = …": [
            lambda: raydl.read_tokens(str(tmp / "ok"), seq_len=16)],
        "ValueError: read_tokens: seq_len must be an integer >= 1, got …": [tokens(seq_len=0)],
        "ValueError: read_tokens: eod must be None or a token id (an integer >= 0), got …": [tokens(seq_len=1, eod=-1)],
        "ValueError: read_tokens: dtype must be 'int64' or 'int32', got …": [tokens(seq_len=1, dtype="float32")],
        "DataSourceError: '…' does not exist (nor do both '…' and '…')": [
            lambda: raydl.read_tokens(str(tmp / "nothing"), seq_len=1)],
        "DataSourceError: … has no … beside it (…); a Megatron dataset is PREFIX.bin and PREFIX.idx": [
            lambda: raydl.read_tokens(str(tmp / "lone*.bin"), seq_len=1)],
        "ValueError: … is neither a Megatron dataset (name it by its prefix: PREFIX.bin and PREFIX.idx) nor a "
        ".parquet file": [lambda: raydl.read_tokens(str(tmp / "notes.txt"), seq_len=1)],
        "ValueError: the … source makes whole batches: per-sample stages (.map, .pad) do not apply to it; use "
        ".map_batches": [lambda: raydl.read_tokens(str(tmp / "ok"), seq_len=2).map(dict).loader(batch_size=2)],
    }


def _mix_triggers(tmp: Path) -> dict[str, list]:
    """The mixing and weights errors, from the calls that raise them."""
    import numpy as np

    import raydl
    from raydl.batch.mixing import Mixing as Mixer
    from raydl.demo import make_images
    from raydl.plan.state import check_mix_state as _check_mix_state
    from raydl.plan.tasks import BatchTask

    make_images(str(tmp / "mixa"), 4, classes=2, seed=0, corrupt=0)
    a = raydl.read_images(str(tmp / "mixa")).decode()
    state = {"sources": ["a", "b"], "weights": [1.0, 1.0], "epoch_size": 8, "batching": "stratified",
             "sample_weights": [None, None], "fingerprints": ["x", "y"]}
    task = BatchTask(rank=0, epoch=0, index=1, ids=np.zeros(2, np.int64), seeds=np.zeros(2, np.uint64))
    return {
        "ValueError: mix(): source '…' decodes …, source '…' …; stratified batches stack them, so they must agree "
        "(decode them to the same size and dtype, or use batching='per_source')": [
            lambda: raydl.mix({"a": a.center_crop(8), "b": a.center_crop(16)}, weights={"a": 1, "b": 1})],
        "ValueError: mix(): weights must name every dataset and no other: missing […], unknown […] (datasets: […])": [
            lambda: raydl.mix({"a": a.center_crop(8)}, weights={"b": 1})],
        "ValueError: mix(): bucketed datasets mix with batching='per_source' (each batch one bucket of one "
        "dataset); stratified batches of several buckets cannot be bucket-pure": [
            lambda: raydl.mix({"a": a.aspect_buckets(64), "b": a.aspect_buckets(64)}, weights={"a": 1, "b": 1})],
        "ValueError: mix(): '…' has aspect_buckets() and '…' has not; bucketed datasets mix only with bucketed "
        "ones": [lambda: raydl.mix({"a": a.aspect_buckets(64), "b": a.center_crop(8)}, weights={"a": 1, "b": 1},
                                   batching="per_source")],
        "ValueError: mix(): '…' and '…' have different aspect buckets; give them the same aspect_buckets(...) "
        "arguments": [lambda: raydl.mix({"a": a.aspect_buckets(64), "b": a.aspect_buckets(96)},
                                        weights={"a": 1, "b": 1}, batching="per_source")],
        "ValueError: mix(): the weight of '…' is …; weights must be finite and >= 0": [
            lambda: raydl.mix({"a": a.center_crop(8)}, weights={"a": -1})],
        "ValueError: …: weight … is …; weights must be finite and >= 0": [
            lambda: a.with_weights([1, float("nan"), 1, 1])],
        "ValueError: …: … weights for … samples; give one a sample": [lambda: a.with_weights([1, 1])],
        "ValueError: cannot resume: the mix's weights changed: the state has {…}, this loader {…}; resume with the "
        "same weights (or start a new epoch plan without the state)": [
            lambda: _check_mix_state({**state, "weights": [2.0, 1.0]}, state)],
        "LoaderError: batch … of rank …, epoch …: field '…' is … per row from source '…' but … from source '…'; "
        "stratified batches stack it, so the sources must agree (or mix with batching='per_source')": [
            lambda: Mixer._concat(task, "emb", [np.zeros((1, 2)), np.zeros((1, 3))], ["a", "b"])],
    }


def _batch_format_triggers() -> dict[str, list]:
    """The iterators' argument errors and the batch conversions', from the functions that raise them."""
    import numpy as np

    from raydl.consume.formats import check_batch_format, to_pandas, to_pyarrow
    from raydl.consume.torch import check_torch_args

    return {
        "ValueError: batch_format must be one of 'numpy', 'pyarrow', 'pandas' (or 'default', which is 'numpy'), "
        "got …": [lambda: check_batch_format("torch")],
        "TypeError: collate_fn must be a callable that takes a batch, got …": [
            lambda: check_batch_format("numpy", collate_fn="stack")],
        "ValueError: collate_fn cannot be used with dtypes, device or pin_memory: what collate_fn returns is yielded "
        "as it is; convert dtypes and move tensors to the device inside collate_fn": [
            lambda: check_torch_args(collate_fn=print, dtypes=None, device="cpu", pin_memory=False)],
        "ValueError: batch column '…' has … rows, the batch …": [
            lambda: to_pyarrow({"id": np.arange(3), "caption": ["a"]})],
        "ValueError: batch column '…' is a …, not one value per row": [lambda: to_pandas({"id": np.arange(3), "n": 7})],
        "ValueError: batch_format='pyarrow': column '…' cannot be an Arrow column: …": [
            lambda: to_pyarrow({"id": np.arange(1), "z": np.array([1j])})],
    }
