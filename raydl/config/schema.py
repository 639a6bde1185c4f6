"""The schema of a YAML config file: one frozen dataclass per section, validated on construction.

    source:   ImagesSource, WebDatasetSource, ParquetSource, TokensSource (SOURCES, by `kind`); read() lists
    pipeline: PipelineConfig, a tuple of StageSpec (a Dataset stage method and its arguments)
    loader:   raydl.options.LoaderConfig
    val:      ValConfig (its own source, pipeline and loader)
    job:      JobConfig;  bench: BenchConfig

Reading a file into them is raydl/config/__init__.py's (`load_config`); a dataclass here imports the
Dataset API (raydl.dataset) only when it is asked to read or apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from raydl.options import AzureOptions, GCSOptions, LoaderConfig, S3Options, check_number, positive_int

__all__ = [
    "SOURCES",
    "BenchConfig",
    "Config",
    "ImagesSource",
    "JobConfig",
    "ParquetSource",
    "PipelineConfig",
    "StageSpec",
    "TokensSource",
    "ValConfig",
    "WebDatasetSource",
]


class _Stores:
    """The object-store sections of a source (`s3:`, `gcs:`, `azure:`), as read_*'s keywords."""

    def stores(self) -> dict:
        return {"s3": self.s3, "gcs": self.gcs, "azure": self.azure}


@dataclass(frozen=True)
class ImagesSource(_Stores):
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
    gcs: GCSOptions | None = None
    azure: AzureOptions | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"source.path must be a non-empty string, got {self.path!r}")
        check_number("source.generate", self.generate, integer=True, at_least=0)

    def read(self):
        """The Dataset of this source (no stages yet)."""
        from raydl.dataset import read_images

        if self.generate and "://" not in self.path and not os.path.exists(self.path):
            _generate_images(self.path, self.generate, self.generate_seed)
        return read_images(self.path, labels=self.labels, **self.stores())


@dataclass(frozen=True)
class WebDatasetSource(_Stores):
    """`source: {kind: webdataset, urls: ...}` -> raydl.read_webdataset(urls, ...): tar shards, local or s3://."""

    kind: ClassVar[str] = "webdataset"
    urls: str | tuple[str, ...]
    image_fields: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    label_field: str | None = "cls"
    fields: Any = None  # None, "all", a list of extensions or a mapping name -> "ext;ext"
    allow_pickle: bool = False
    s3: S3Options | None = None
    gcs: GCSOptions | None = None
    azure: AzureOptions | None = None

    def read(self):
        from raydl.dataset import read_webdataset

        urls = self.urls if isinstance(self.urls, str) else list(self.urls)
        fields = list(self.fields) if isinstance(self.fields, tuple) else self.fields
        return read_webdataset(
            urls,
            **self.stores(),
            fields=fields,
            image_fields=tuple(self.image_fields),
            label_field=self.label_field,
            allow_pickle=self.allow_pickle,
        )


@dataclass(frozen=True)
class ParquetSource(_Stores):
    """`source: {kind: parquet, paths: ..., columns: [...], image_column: ...}` -> raydl.read_parquet(...),
    local or s3://."""

    kind: ClassVar[str] = "parquet"
    paths: str | tuple[str, ...]
    columns: tuple[str, ...] | None = None
    image_column: str | None = None
    label_column: str | None = None
    s3: S3Options | None = None
    gcs: GCSOptions | None = None
    azure: AzureOptions | None = None

    def read(self):
        from raydl.dataset import read_parquet

        paths = self.paths if isinstance(self.paths, str) else list(self.paths)
        columns = None if self.columns is None else list(self.columns)
        return read_parquet(
            paths,
            columns=columns,
            image_column=self.image_column,
            label_column=self.label_column,
            **self.stores(),
        )


@dataclass(frozen=True)
class TokensSource(_Stores):
    """`source: {kind: tokens, paths: ..., seq_len: N}` -> raydl.read_tokens(...): Megatron-LM indexed
    datasets (named by prefix) and Parquet token tables, local or s3://, cut into windows of seq_len + 1."""

    kind: ClassVar[str] = "tokens"
    paths: str | tuple[str, ...]
    seq_len: int
    column: str = "input_ids"
    eod: int | None = None
    dtype: str = "int64"
    s3: S3Options | None = None
    gcs: GCSOptions | None = None
    azure: AzureOptions | None = None

    def __post_init__(self) -> None:
        if isinstance(self.paths, str) and not self.paths:
            raise ValueError("source.paths must be a non-empty string or list, got ''")
        positive_int("source.seq_len", self.seq_len)
        if self.eod is not None:
            check_number("source.eod", self.eod, integer=True, at_least=0)
        if self.dtype not in ("int64", "int32"):
            raise ValueError(f"source.dtype must be 'int64' or 'int32', got {self.dtype!r}")
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"source.column must be a non-empty string, got {self.column!r}")

    def read(self):
        from raydl.dataset import read_tokens

        paths = self.paths if isinstance(self.paths, str) else list(self.paths)
        return read_tokens(
            paths,
            seq_len=self.seq_len,
            column=self.column,
            eod=self.eod,
            dtype=self.dtype,
            **self.stores(),
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


SOURCES: dict[str, type] = {
    "images": ImagesSource,
    "parquet": ParquetSource,
    "tokens": TokensSource,
    "webdataset": WebDatasetSource,
}


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

    lr: float = 0.01
    """Adam's learning rate."""

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
