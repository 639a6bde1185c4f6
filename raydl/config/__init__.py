"""The YAML config files: their schema (frozen dataclasses, validated on construction) and `load_config`.

The top floor of the data path: a config file names a source, the Dataset
stages and the loader's options (raydl.options.LoaderConfig, which is what
`Dataset.loader(...)` builds), so this module sits above raydl.dataset and
imports it where a config is turned into a Dataset. A file under configs/
holds these sections (see docs/configs.md):

    source:   where the samples are  -> raydl.read_images / read_webdataset / read_parquet / read_tokens
    pipeline: the Dataset stage methods, in order (decode, random_resized_crop, ...)
    loader:   LoaderConfig fields
    val:      optional validation data: its own source, pipeline and loader fields
    job:      the training job of examples/train.py (workers, epochs, state_dir, ...)
    bench:    `raydl bench cluster` settings

`load_config(path, overrides=["loader.batch_size=128"])` reads one; an unknown
key anywhere is a ValueError naming the key and the file. String values may
name environment variables: `${DATA_ROOT}`, `${DATA_ROOT:-/data}`, and a default may name
others: `${DATA_ROOT:-${HOME}/data}`.

`LoaderConfig`, `S3Options`, `GCSOptions` and `AzureOptions` are importable from here too (they live in
raydl.options). The package, along its seams: schema.py holds the sections'
dataclasses (re-exported here), raw.py the `${VAR}` expansion and `--set`
overrides applied to the parsed YAML, and this module reads a file into the
schema, naming the file and the key on every error.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import MISSING, fields, replace

from raydl.config.raw import apply_override, check_size, expand, load_yaml, parse_override
from raydl.config.schema import (
    SOURCES,
    BenchConfig,
    Config,
    ImagesSource,
    JobConfig,
    ParquetSource,
    PipelineConfig,
    StageSpec,
    TokensSource,
    ValConfig,
    WebDatasetSource,
)
from raydl.options import AzureOptions, Cache, GCSOptions, LoaderConfig, S3Options

__all__ = [
    "AzureOptions",
    "BenchConfig",
    "Config",
    "GCSOptions",
    "ImagesSource",
    "JobConfig",
    "LoaderConfig",
    "ParquetSource",
    "PipelineConfig",
    "S3Options",
    "StageSpec",
    "TokensSource",
    "ValConfig",
    "WebDatasetSource",
    "load_config",
    "load_loader_config",
]

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
        stores = {
            name: self.build(cls, data[name], f"{key}.{name}")
            for name, cls in (("s3", S3Options), ("gcs", GCSOptions), ("azure", AzureOptions))
            if data.get(name) is not None
        }
        return self.build(SOURCES[kind], data, key, skip=("kind", "s3", "gcs", "azure"), **stores)

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


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """A Config from a YAML file; `overrides` like "loader.batch_size=128" (the CLI's --set) win.

    An unknown key, stage or source kind is a ValueError naming it and the file.
    """
    path = os.fspath(path)
    data, overridden = _edited(_read_yaml(path), path, overrides)
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
    val = _val(r, data["val"], loader) if data.get("val") is not None else None
    return Config(
        source=r.source(data["source"], "source"),
        pipeline=r.pipeline(data.get("pipeline"), "pipeline"),
        loader=loader,
        val=val,
        job=job,
        bench=r.build(BenchConfig, data.get("bench"), "bench"),
        path=path,
    )


def _read_yaml(path: str) -> dict:
    """The file's YAML, which must be a mapping (an empty file is an empty one)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f, path) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config {path!r}: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with sections {list(_TOP)}, got {type(data).__name__}")
    return data


def _edited(data: dict, path: str, overrides: Sequence[str]) -> tuple[dict, set[str]]:
    """A copy of `data` with `${VAR}`s expanded and the `--set` overrides applied, refused when it is too
    large (raydl/config/raw.py); and the keys the overrides set."""
    data = expand(data, path)
    overridden = set()
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        apply_override(data, parts, value, path, item)
        overridden.add(".".join(parts))
    check_size(data, path)
    return data, overridden


def _val(r: _Reader, section: object, loader: LoaderConfig) -> ValConfig:
    """The `val:` section; its loader starts from the training loader's fields, unshuffled, on one rank."""
    v = r.mapping(section, "val")
    for k in v:
        if k not in ("source", "pipeline", "loader"):
            raise ValueError(
                f"{r.where('val.' + k)}: unknown key `val.{k}`; `val` takes ['loader', 'pipeline', 'source']"
            )
    if "source" not in v:
        raise ValueError(f"{r.path}: `val` needs a `val.source`")
    val_loader = {
        **{f.name: getattr(loader, f.name) for f in fields(LoaderConfig)},
        "shuffle": False,
        "world_size": 1,
        **r.mapping(v.get("loader"), "val.loader"),
    }
    return ValConfig(
        r.source(v["source"], "val.source"),
        r.pipeline(v.get("pipeline"), "val.pipeline"),
        r.build(LoaderConfig, _with_cache(r, val_loader, "val.loader"), "val.loader"),
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
