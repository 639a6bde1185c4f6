"""The YAML config files: their schema (frozen dataclasses, validated on construction) and `load_config`.

The top floor of the data path: a config file names a source, the Dataset
stages and the loader's options (raydl.options.LoaderConfig, which is what
`Dataset.loader(...)` builds), so this module sits above raydl.dataset and
imports it where a config is turned into a Dataset. A file under configs/
holds these sections (see docs/configs.md):

    source:   where the samples are  -> raydl.read_images / read_webdataset / read_parquet
    pipeline: the Dataset stage methods, in order (decode, random_resized_crop, ...)
    loader:   LoaderConfig fields
    val:      optional validation data: its own source, pipeline and loader fields
    job:      the training job of examples/train.py (workers, epochs, state_dir, ...)
    bench:    `raydl bench cluster` settings

`load_config(path, overrides=["loader.batch_size=128"])` reads one; an unknown
key anywhere is a ValueError naming the key and the file. String values may
name environment variables: `${DATA_ROOT}`, `${DATA_ROOT:-/data}`, and a default may name
others: `${DATA_ROOT:-${HOME}/data}`.

`LoaderConfig` and `S3Options` are importable from here too (they live in
raydl.options).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar

from raydl.env import environment_variable
from raydl.options import Cache, LoaderConfig, S3Options, check_number, positive_int

__all__ = [
    "BenchConfig",
    "Config",
    "ImagesSource",
    "JobConfig",
    "LoaderConfig",
    "ParquetSource",
    "PipelineConfig",
    "S3Options",
    "StageSpec",
    "ValConfig",
    "WebDatasetSource",
    "load_config",
    "load_loader_config",
]


# -- the YAML config files --------------------------------------------------------------------
@dataclass(frozen=True)
class ImagesSource:
    """`source: {kind: images, path: ...}` -> raydl.read_images(path, labels=labels).

    `generate: N` writes N generated demo images (raydl.util.synthetic.make_images, seeded
    by `generate_seed`) into `path` first when it does not exist yet, so a demo
    config runs anywhere; leave it 0 for real data.
    """

    kind: ClassVar[str] = "images"
    path: str
    labels: str | None = "folder"
    generate: int = 0
    generate_seed: int = 0
    s3: S3Options | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"source.path must be a non-empty string, got {self.path!r}")
        check_number("source.generate", self.generate, integer=True, at_least=0)

    def read(self):
        """The Dataset of this source (no stages yet)."""
        from raydl.dataset import read_images

        if self.generate and "://" not in self.path and not os.path.exists(self.path):
            _generate_images(self.path, self.generate, self.generate_seed)
        return read_images(self.path, labels=self.labels, s3=self.s3)


@dataclass(frozen=True)
class WebDatasetSource:
    """`source: {kind: webdataset, urls: ...}` -> raydl.read_webdataset(urls, ...): tar shards, local or s3://."""

    kind: ClassVar[str] = "webdataset"
    urls: str | tuple[str, ...]
    image_fields: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    label_field: str | None = "cls"
    fields: Any = None  # None, "all", a list of extensions or a mapping name -> "ext;ext"
    allow_pickle: bool = False
    s3: S3Options | None = None

    def read(self):
        from raydl.dataset import read_webdataset

        urls = self.urls if isinstance(self.urls, str) else list(self.urls)
        fields = list(self.fields) if isinstance(self.fields, tuple) else self.fields
        return read_webdataset(
            urls,
            s3=self.s3,
            fields=fields,
            image_fields=tuple(self.image_fields),
            label_field=self.label_field,
            allow_pickle=self.allow_pickle,
        )


@dataclass(frozen=True)
class ParquetSource:
    """`source: {kind: parquet, paths: ..., columns: [...], image_column: ...}` -> raydl.read_parquet(...),
    local or s3://."""

    kind: ClassVar[str] = "parquet"
    paths: str | tuple[str, ...]
    columns: tuple[str, ...] | None = None
    image_column: str | None = None
    label_column: str | None = None
    s3: S3Options | None = None

    def read(self):
        from raydl.dataset import read_parquet

        paths = self.paths if isinstance(self.paths, str) else list(self.paths)
        columns = None if self.columns is None else list(self.columns)
        return read_parquet(
            paths, columns=columns, image_column=self.image_column, label_column=self.label_column, s3=self.s3
        )


def _generate_images(path: str, n: int, seed: int) -> None:
    """Demo images written to a sibling folder and renamed into place, so concurrent readers never see
    half."""
    import tempfile

    from raydl.util.synthetic import make_images

    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".raydl-gen-", dir=parent)
    make_images(tmp, n, seed=seed, corrupt=0)
    try:
        os.rename(tmp, path)
    except OSError:  # another process made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


SOURCES: dict[str, type] = {"images": ImagesSource, "parquet": ParquetSource, "webdataset": WebDatasetSource}


@dataclass(frozen=True)
class StageSpec:
    """One `pipeline:` entry: a Dataset stage method and its keyword arguments."""

    method: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def apply(self, ds):
        return getattr(ds, self.method)(**dict(self.kwargs))


@dataclass(frozen=True)
class PipelineConfig:
    """The `pipeline:` list: Dataset stage methods applied in order."""

    stages: tuple[StageSpec, ...] = ()

    def apply(self, ds):
        for st in self.stages:
            ds = st.apply(ds)
        return ds


@dataclass(frozen=True)
class ValConfig:
    """`val:`: validation data beside the training data (its loader defaults to the training loader's
    settings with shuffle off and world_size 1, for one evaluator)."""

    source: Any
    pipeline: PipelineConfig
    loader: LoaderConfig


@dataclass(frozen=True)
class JobConfig:
    """`job:`: the training job of examples/train.py."""

    workers: int = 2
    """Ray Train workers (ranks); the loader's world_size is set to this unless `loader:` says otherwise."""

    cpus_per_worker: float = 0.5
    """CPUs each Ray Train worker reserves."""

    epochs: int = 2

    steps_per_epoch: int | None = None
    """Train at most this many steps per epoch (None: the whole epoch)."""

    lr: float = 0.05

    state_dir: str | None = None
    """Model and iterator state after every epoch; a resubmitted job resumes from it."""

    storage_path: str | None = None
    """Ray Train's storage (default: a folder under state_dir, or /tmp)."""

    evaluate: bool = True
    """An evaluation actor fetches each epoch's weights peer to peer and runs `val`."""

    def __post_init__(self) -> None:
        positive_int("job.workers", self.workers)
        positive_int("job.epochs", self.epochs)
        check_number("job.steps_per_epoch", self.steps_per_epoch, integer=True, above=0, optional=True)
        check_number("job.cpus_per_worker", self.cpus_per_worker, above=0)


@dataclass(frozen=True)
class BenchConfig:
    """`bench:`: defaults for `raydl bench cluster` (its command-line flags win)."""

    simulate_nodes: int | None = None
    """Simulated nodes (ray.cluster_utils.Cluster) on this machine, instead of --address."""

    cpus_per_node: int = 1
    ranks: int = 4
    epochs: int = 1

    checkpoint_mib: int = 64
    """The state dict broadcast to every node after the run, in MiB."""

    images: int = 512
    """Images generated when the source folder is missing (source.generate wins)."""

    def __post_init__(self) -> None:
        check_number("bench.simulate_nodes", self.simulate_nodes, integer=True, above=0, optional=True)
        for name in ("cpus_per_node", "ranks", "epochs", "checkpoint_mib", "images"):
            positive_int(f"bench.{name}", getattr(self, name))


@dataclass(frozen=True)
class Config:
    """One YAML config file: what to read, how to transform it, how to load it, and the job around it."""

    source: Any
    pipeline: PipelineConfig
    loader: LoaderConfig
    val: ValConfig | None = None
    job: JobConfig = field(default_factory=JobConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    path: str | None = None  # the file it was read from

    def dataset(self):
        """The training Dataset: the source read (listed once) with the pipeline's stages."""
        return self.pipeline.apply(self.source.read())

    def val_dataset(self):
        if self.val is None:
            raise ValueError(f"{self.path or 'config'}: has no `val:` section")
        return self.val.pipeline.apply(self.val.source.read())


_TOP = ("source", "pipeline", "loader", "val", "job", "bench")


class _Reader:
    """Builds dataclasses from the parsed YAML, naming the file and the key on every error."""

    def __init__(self, path: str, overridden: set[str]) -> None:
        self.path = path
        self.overridden = overridden

    def where(self, key: str) -> str:
        return f"{self.path} (--set {key})" if key in self.overridden else self.path

    def mapping(self, value: object, key: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"{self.where(key)}: `{key}` must be a mapping, got {type(value).__name__}")
        return value

    def build(self, cls: type, data: object, key: str, *, skip: Sequence[str] = (), **extra: object):
        data = {k: v for k, v in self.mapping(data, key).items() if k not in skip}
        known = [f.name for f in fields(cls) if f.init and f.name not in extra]
        for k in data:
            if k not in known:
                full = f"{key}.{k}"
                raise ValueError(f"{self.where(full)}: unknown key `{full}`; `{key}` takes {sorted(known)}")
        missing = [
            f.name
            for f in fields(cls)
            if f.init
            and f.name not in data
            and f.name not in extra
            and f.default is MISSING
            and f.default_factory is MISSING
        ]
        if missing:
            raise ValueError(f"{self.path}: `{key}` needs {', '.join(f'`{key}.{m}`' for m in missing)}")
        try:
            return cls(**{k: _frozen(v) for k, v in data.items()}, **extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.path}: `{key}`: {exc}") from exc

    def source(self, data: object, key: str):
        data = self.mapping(data, key)
        kind = data.get("kind", "images")
        if kind not in SOURCES:
            raise ValueError(
                f"{self.where(key + '.kind')}: unknown source kind {kind!r} in `{key}.kind`; "
                f"one of {sorted(SOURCES)}"
            )
        s3 = self.build(S3Options, data["s3"], f"{key}.s3") if data.get("s3") is not None else None
        return self.build(SOURCES[kind], data, key, skip=("kind", "s3"), **({"s3": s3} if s3 else {}))

    def pipeline(self, data: object, key: str) -> PipelineConfig:
        if data is None:
            return PipelineConfig()
        if not isinstance(data, list):
            raise ValueError(
                f"{self.where(key)}: `{key}` must be a list of stages, e.g. [decode, "
                f"{{random_resized_crop: {{size: 224}}}}]"
            )
        from raydl.dataset import Dataset

        stages = []
        for i, item in enumerate(data):
            if isinstance(item, str):
                method, kwargs = item, {}
            elif isinstance(item, dict) and len(item) == 1:
                method, kwargs = next(iter(item.items()))
                kwargs = self.mapping(kwargs, f"{key}.{i}")
            else:
                raise ValueError(
                    f"{self.path}: `{key}[{i}]` must be a stage name or a one-key mapping "
                    f"{{stage: {{arg: value}}}}, got {item!r}"
                )
            if method not in _stage_methods(Dataset):
                raise ValueError(
                    f"{self.where(f'{key}.{i}')}: unknown stage `{key}[{i}].{method}`; stages are "
                    f"{sorted(_stage_methods(Dataset))}"
                )
            params = _stage_methods(Dataset)[method]
            for k in kwargs:
                if k not in params:
                    raise ValueError(
                        f"{self.where(f'{key}.{method}.{k}')}: unknown key `{key}[{i}].{method}.{k}`; "
                        f"`{method}` takes {sorted(params)}"
                    )
            stages.append(StageSpec(method, tuple((k, _frozen(v)) for k, v in kwargs.items())))
        return PipelineConfig(tuple(stages))


def _stage_methods(cls) -> dict[str, tuple[str, ...]]:
    """Dataset methods that add a stage (those returning a Dataset), with their argument names."""
    out = {}
    for name, fn in vars(cls).items():
        # map and map_batches take a Python function, which a YAML file cannot hold
        if (
            name.startswith("_")
            or not callable(fn)
            or name in ("loader", "loader_from_config", "map", "map_batches")
        ):
            continue
        sig = inspect.signature(fn)
        if sig.return_annotation not in ("Dataset", cls):
            continue
        out[name] = tuple(p for p in sig.parameters if p != "self")
    return out


def _frozen(value: object) -> object:
    """YAML lists become tuples, so configs stay hashable and immutable."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def _closing(text: str, start: int) -> int:
    """Index of the "}" that closes a "${" whose body starts at `start` (nested "${...}" inside), or -1."""
    depth = 1
    for i in range(start, len(text)):
        if text.startswith("${", i):
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _substitute(text: str, path: str) -> str:
    """`${VAR}` and `${VAR:-default}` in one string; a default may name variables itself, and is read only
    when VAR is unset (`${RAYDL_DEMO_DIR:-${HOME}/.cache/raydl}`). Anything else is left as written."""
    out, i = [], 0
    while (m := _ENV.search(text, i)) is not None:
        close = _closing(text, m.end())
        body = text[m.end() : close]
        if close < 0 or body and not body.startswith(":-"):
            out.append(text[i : m.end()])
            i = m.end()
            continue
        got = environment_variable(m.group(1))
        if got is None and not body:
            raise ValueError(
                f"{path}: ${{{m.group(1)}}} is not set (write ${{{m.group(1)}:-default}} for a default)"
            )
        out += [text[i : m.start()], got if got is not None else _substitute(body[2:], path)]
        i = close + 1
    return "".join(out) + text[i:]


def _expand(value: object, path: str) -> object:
    """`${VAR}` and `${VAR:-default}` in string values, from the environment (e.g. a data root per
    cluster)."""
    if isinstance(value, dict):
        return {k: _expand(v, path) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, path) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    return _substitute(value, path)


def _parse_override(item: str) -> tuple[list[str], object]:
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes section.key=value (e.g. loader.batch_size=128), got {item!r}")
    return key.strip().split("."), yaml.safe_load(raw)


def _apply_override(data: dict, parts: list[str], value: object, path: str, item: str) -> None:
    """Set data[parts[0]][parts[1]]... = value; a pipeline stage is named by its method or its index."""
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):  # a pipeline: `part` names a stage, the next part one of its arguments
            i = _stage_index(node, part, path, item)
            if isinstance(node[i], str):
                node[i] = {node[i]: {}}
            if not isinstance(node[i], dict) or len(node[i]) != 1:
                raise ValueError(f"{path}: --set {item}: pipeline stage {part!r} is not a one-key mapping")
            name = next(iter(node[i]))
            if node[i][name] is None:
                node[i][name] = {}
            node = node[i][name]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise ValueError(f"{path}: --set {item}: `{'.'.join(parts[:depth])}` is not a section")
    if isinstance(node, list):
        node[_stage_index(node, parts[-1], path, item)] = value
    elif isinstance(node, dict):
        node[parts[-1]] = value
    else:
        raise ValueError(f"{path}: --set {item}: `{'.'.join(parts[:-1])}` is not a section")


def _stage_index(stages: list, part: str, path: str, item: str) -> int:
    if part.isdigit() and int(part) < len(stages):
        return int(part)
    for i, st in enumerate(stages):
        if st == part or (isinstance(st, dict) and part in st):
            return i
    raise ValueError(f"{path}: --set {item}: no pipeline stage `{part}`")


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """A Config from a YAML file; `overrides` like "loader.batch_size=128" (the CLI's --set) win.

    An unknown key, stage or source kind is a ValueError naming it and the file.
    """
    import copy

    import yaml

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config {path!r}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with sections {list(_TOP)}, got {type(data).__name__}")
    data = _expand(copy.deepcopy(data), path)
    overridden = set()
    for item in overrides:
        parts, value = _parse_override(item)
        _apply_override(data, parts, value, path, item)
        overridden.add(".".join(parts))
    r = _Reader(path, overridden)
    for key in data:
        if key not in _TOP:
            raise ValueError(f"{r.where(key)}: unknown key `{key}`; sections are {list(_TOP)}")
    if "source" not in data:
        raise ValueError(f"{path}: needs a `source:` section (e.g. {{kind: images, path: /data/train}})")
    if "loader" not in data:
        raise ValueError(f"{path}: needs a `loader:` section (at least `batch_size`)")
    job = r.build(JobConfig, data.get("job"), "job")
    loader_data = dict(r.mapping(data["loader"], "loader"))
    if "world_size" not in loader_data and "job" in data:
        loader_data["world_size"] = job.workers  # one rank per training worker unless the file says otherwise
    loader = r.build(LoaderConfig, _with_cache(r, loader_data, "loader"), "loader")
    val = None
    if data.get("val") is not None:
        v = r.mapping(data["val"], "val")
        for k in v:
            if k not in ("source", "pipeline", "loader"):
                raise ValueError(
                    f"{r.where('val.' + k)}: unknown key `val.{k}`; `val` takes "
                    f"['loader', 'pipeline', 'source']"
                )
        if "source" not in v:
            raise ValueError(f"{path}: `val` needs a `val.source`")
        val_loader = {
            **{f.name: getattr(loader, f.name) for f in fields(LoaderConfig)},
            "shuffle": False,
            "world_size": 1,
            **r.mapping(v.get("loader"), "val.loader"),
        }
        val = ValConfig(
            r.source(v["source"], "val.source"),
            r.pipeline(v.get("pipeline"), "val.pipeline"),
            r.build(LoaderConfig, _with_cache(r, val_loader, "val.loader"), "val.loader"),
        )
    return Config(
        source=r.source(data["source"], "source"),
        pipeline=r.pipeline(data.get("pipeline"), "pipeline"),
        loader=loader,
        val=val,
        job=job,
        bench=r.build(BenchConfig, data.get("bench"), "bench"),
        path=path,
    )


def _with_cache(r: _Reader, loader: dict, key: str) -> dict:
    """A loader section with its `cache: {path, max_bytes}` mapping made a raydl.Cache (null: no cache)."""
    value = loader.get("cache")
    if value is None or isinstance(value, Cache):
        return loader
    return {**loader, "cache": r.build(Cache, value, f"{key}.cache")}


def load_loader_config(path: str | os.PathLike, **overrides: object) -> LoaderConfig:
    """The LoaderConfig of a config file (its `loader:` section); keyword overrides win."""
    return replace(load_config(path).loader, **overrides)
