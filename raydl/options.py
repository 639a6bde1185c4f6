"""Options: how a loader runs (LoaderConfig) and how raydl talks to S3 (S3Options), validated on construction.

The bottom floor of the package: it imports nothing of raydl but `errors`, so
every layer above (storage, sources, plan, execute, the YAML config) can take
its options from here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ON_ERROR", "LoaderConfig", "S3Options", "is_positive_int", "positive_int"]

ON_ERROR = ("skip", "replace", "raise")


def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive_int(name: str, value: object) -> int:
    """`value` when it is an int > 0 (not a bool); else ValueError naming `name`. raydl's one such check."""
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class LoaderConfig:
    """How a loader plans and runs an epoch. See `Dataset.loader` for each field."""

    batch_size: int
    world_size: int = 1
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    on_error: str = "skip"
    num_workers: int = 1
    threads_per_worker: int | None = None
    cpus_per_worker: float = 0.0
    node_resource: str | None = None
    prefetch_batches: int = 2
    object_store_budget: int | None = None
    io_concurrency: int | None = None

    def __post_init__(self) -> None:
        positive_int("batch_size", self.batch_size)
        positive_int("world_size", self.world_size)
        positive_int("prefetch_batches", self.prefetch_batches)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        positive_int("num_workers", self.num_workers)
        if self.object_store_budget is not None:
            positive_int("object_store_budget", self.object_store_budget)
        if self.node_resource is not None and not (
            isinstance(self.node_resource, str) and self.node_resource
        ):
            raise ValueError(f"node_resource must be a non-empty resource name, got {self.node_resource!r}")
        if self.threads_per_worker is not None:
            positive_int("threads_per_worker", self.threads_per_worker)
        if self.io_concurrency is not None:
            positive_int("io_concurrency", self.io_concurrency)
        if not (isinstance(self.cpus_per_worker, (int, float)) and self.cpus_per_worker >= 0):
            raise ValueError(f"cpus_per_worker must be a number >= 0, got {self.cpus_per_worker!r}")


@dataclass(frozen=True)
class S3Options:
    """How raydl talks to S3 or an S3-compatible store. Unset fields fall back to boto3's own
    configuration (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, ~/.aws, instance roles).

    max_concurrency: concurrent GETs per loader actor (and its connection pool size).
    retries: tries per request in all, on throttling (503 SlowDown), 5xx and connection errors,
    with exponential backoff and jitter; never on 403/404. timeout_s: connect and read timeout
    of one request, and the time after which a read stops retrying.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    max_concurrency: int = 64
    retries: int = 5
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("endpoint_url", "region", "profile"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be a non-empty str or None, got {value!r}")
        positive_int("max_concurrency", self.max_concurrency)
        positive_int("retries", self.retries)
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or self.timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
