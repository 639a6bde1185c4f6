"""Options: how a loader runs (LoaderConfig) and how raydl talks to object stores (S3Options, GCSOptions,
AzureOptions), validated on construction.

The bottom floor of the package: it imports nothing of raydl but `errors`, so
every layer above (storage, sources, plan, execute, the YAML config) takes its
options from here. Each option is written once, with its docstring under the
field; `Dataset.loader(**options)` and the `loader:` section of a YAML config
take exactly these fields.

`check_number` is raydl's one check of a numeric argument (never a bool,
optionally an int, within bounds), used by every layer.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

__all__ = [
    "ON_ERROR",
    "AzureOptions",
    "Cache",
    "GCSOptions",
    "LoaderConfig",
    "S3Options",
    "check_number",
    "check_on_error",
    "is_positive_int",
    "keyword_signature",
    "loader_config",
    "positive_int",
]

ON_ERROR = ("skip", "replace", "raise")
NUMBER_TYPES: tuple[type, ...] = (int, float)  # what check_number takes as a number unless told otherwise


def check_number(
    name: str,
    value: object,
    *,
    integer: bool = False,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    finite: bool = False,
    optional: bool = False,
    types: tuple[type, ...] = NUMBER_TYPES,
):
    """`value` when it is a number (a Python int where `integer`, else one of `types`; never a bool) within
    the bounds given (> `above`, >= `at_least`, < `below`, <= `at_most`), finite where `finite`, or None
    where `optional`. Anything else is a ValueError that names `name`, says what it must be and shows the
    value."""
    if value is None and optional:
        return None
    ok = isinstance(value, int if integer else types) and not isinstance(value, bool)
    if ok:
        ok = (
            (above is None or value > above)
            and (at_least is None or value >= at_least)
            and (below is None or value < below)
            and (at_most is None or value <= at_most)
            and (not finite or math.isfinite(value))
        )
    if not ok:
        raise ValueError(f"{name} must be {_wanted(integer, above, at_least, below, at_most)}, got {value!r}")
    return value


def _wanted(integer: bool, above, at_least, below, at_most) -> str:
    """'a positive int', 'a number >= 0', 'an int in [0, 2**63)': what check_number asked for, in words."""
    noun = "an int" if integer else "a number"
    low = next(((b, v) for b, v in (("(", above), ("[", at_least)) if v is not None), None)
    high = next(((b, v) for b, v in ((")", below), ("]", at_most)) if v is not None), None)
    if low == ("(", 0) and high is None:
        return f"a positive {noun.split()[-1]}"
    text = {2**63: "2**63"}
    if low and high:
        return f"{noun} in {low[0]}{low[1]:g}, {text.get(high[1], f'{high[1]:g}')}{high[0]}"
    ops = {"(": ">", "[": ">=", ")": "<", "]": "<="}
    return " ".join([noun, *(f"{ops[b[0]]} {b[1]:g}" for b in (low, high) if b)])


def check_on_error(value: object) -> str:
    """`value` when it is one of ON_ERROR; else a ValueError naming on_error."""
    if value not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {value!r}")
    return value  # type: ignore[return-value]


def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive_int(name: str, value: object) -> int:
    """`value` when it is an int > 0 (not a bool); else ValueError naming `name` (check_number's common
    case)."""
    return check_number(name, value, integer=True, above=0)


def _name(name: str, value: object) -> None:
    """A non-empty string, or None."""
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{name} must be a non-empty str or None, got {value!r}")


@dataclass(frozen=True)
class Cache:
    """A node-local cache of remote bytes: `loader(cache=raydl.Cache(path, max_bytes=...))`, and a YAML
    config's `loader.cache: {path: ..., max_bytes: ..., group: ...}` (see "Node cache" in docs/loader.md,
    and docs/security.md for who can read and write it)."""

    path: str
    """The cache folder on every node's local disk (made where missing); every loader and process on a
    node that names it shares it, and it outlives the job, so a job submitted again starts warm. It is
    private to its user (folders 0700, files 0600): a folder that is a symbolic link or another user's is
    refused."""

    max_bytes: int
    """The most bytes the folder's entries may take on each node; the least recently used go first."""

    group: str | None = None
    """None: the cache is its user's alone. A group's name: the folder is shared by that group's members
    (folders 2770, files 0660, all of the group), who then trust each other with the cache's bytes."""

    def __post_init__(self) -> None:
        if not (isinstance(self.path, str) and self.path):
            raise ValueError(f"Cache.path must be a non-empty str, got {self.path!r}")
        positive_int("Cache.max_bytes", self.max_bytes)
        if self.group is not None and not (
            isinstance(self.group, str) and self.group.strip() == self.group != ""
        ):
            raise ValueError(
                f"Cache.group must be None or a group's name (a non-empty str), got {self.group!r}"
            )


@dataclass(frozen=True)
class LoaderConfig:
    """How a loader plans and runs an epoch: what `Dataset.loader(**options)` builds, and a YAML config's
    `loader:` section. Only `batch_size` is required."""

    batch_size: int
    """Samples per batch. The last batch of a rank's epoch is shorter unless `drop_last`; with aspect
    buckets, each bucket's last batch is."""

    world_size: int = 1
    """Trainer ranks. Each takes its own iterator (`loader.iterator(rank)`), and every rank gets the same
    number of batches per epoch."""

    seed: int = 0
    """Seeds the shuffle and every sample's augmentation, with the epoch: the same seed gives the same
    batches and pixels in every run. An int in [0, 2**63)."""

    shuffle: bool = True
    """Reshuffle the samples every epoch (a keyed permutation of the catalog); False keeps catalog order."""

    drop_last: bool = False
    """Leave out the epoch's last, partial batches, so that every batch holds `batch_size` rows."""

    on_error: str = "skip"
    """What a sample whose bytes cannot be decoded, or that lacks a field its source selects, does to its
    batch. "skip": it is left out (the batch is one row shorter, maybe 0 rows, with a warning) and counted;
    "replace": a substitute drawn from the failed slot's seed (the same in every run) stands in, so batches
    keep `batch_size` rows; "raise": the epoch stops with SampleDecodeError (MissingFieldError for a
    missing field) naming the file. Only those (and, under "replace", unreadable files) are covered: any
    other failure is a LoaderError."""

    num_workers: int = 1
    """Loader actors started on every alive node with CPUs (and `node_resource`, when given), and on nodes
    that join later."""

    threads_per_worker: int | None = None
    """Decode threads per actor. Default: one per CPU of its node, or ceil(cpus_per_worker) when that is
    set."""

    cpus_per_worker: float = 0.0
    """CPUs each actor reserves in Ray's accounting. 0 (the default) reserves none, so loaders never block
    training actors or each other; x > 0 reserves x and waits up to 10 s for room, else a LoaderError
    naming what holds the CPUs."""

    node_resource: str | None = None
    """Only nodes that have this custom Ray resource (e.g. a label given to `ray start --resources`) run
    loader actors."""

    prefetch_batches: int = 2
    """Batch tasks each rank keeps in flight; fewer when the loader's batches would not fit
    `object_store_budget`."""

    object_store_budget: int | None = None
    """Bytes of object store the loader's batches in flight may take, all ranks together. Default: a quarter
    of the smallest node's object store."""

    io_concurrency: int | None = None
    """IO threads per actor, apart from its decode threads. Default: the storage's (4 for local disk,
    `S3Options.max_concurrency` for S3)."""

    max_sample_bytes: int = 256 << 20
    """The most bytes one sample may be: an image file, a tar member, a Parquet cell. A larger sample is a
    sample error under `on_error` naming it and its size, and is not read where the listing gave its size
    (image files, tar members)."""

    batch_timeout_s: float = 300.0
    """The least time `iter_batches()` waits for one batch before a BatchTimeoutError, when its own
    `timeout_s` is not given: it waits max(batch_timeout_s, 10 × the longest wait for a batch so far), and
    2 × batch_timeout_s for an iterator's first batch (actors starting, first reads). 300 s outlasts one S3
    read's retries at the default S3Options (30 s × 5), so a stalled store is reported as itself first.
    `float("inf")` waits forever (raydl/plan/timeouts.py)."""

    shuffle_window: int | None = None
    """With shuffle: 0 shuffles the samples of the whole epoch together; k > 0 shuffles the parts (Parquet
    row groups, tar shards, files) and then the samples within each run of k consecutive parts, so that a
    batch reads a few parts, not all of them. None (the default): 16 for a source that decodes a whole part
    to cut one sample out (Parquet row groups), else 0. A pure function of the seed and epoch either way."""

    cache: Cache | None = None
    """Keep the remote bytes the workers fetch (tar ranges, Parquet footers and column chunks, image
    objects) on each node's local disk, verified on every read, so later epochs (and later jobs on the same
    nodes) read no object store. None: no cache. Local files are read directly, never cached."""

    def __post_init__(self) -> None:
        if self.cache is not None and not isinstance(self.cache, Cache):
            raise ValueError(f"cache must be a raydl.Cache or None, got {type(self.cache).__name__}")
        for name in ("batch_size", "world_size", "prefetch_batches", "num_workers", "max_sample_bytes"):
            positive_int(name, getattr(self, name))
        for name in ("threads_per_worker", "io_concurrency", "object_store_budget"):
            check_number(name, getattr(self, name), integer=True, above=0, optional=True)
        check_number("shuffle_window", self.shuffle_window, integer=True, at_least=0, optional=True)
        check_number("seed", self.seed, integer=True, at_least=0, below=2**63)
        check_number("cpus_per_worker", self.cpus_per_worker, at_least=0)
        check_number("batch_timeout_s", self.batch_timeout_s, above=0)
        check_on_error(self.on_error)
        if self.node_resource is not None and not (
            isinstance(self.node_resource, str) and self.node_resource
        ):
            raise ValueError(f"node_resource must be a non-empty resource name, got {self.node_resource!r}")


@dataclass(frozen=True)
class S3Options:
    """How raydl talks to S3 or an S3-compatible store. Unset fields fall back to boto3's own
    configuration (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, ~/.aws, instance roles)."""

    endpoint_url: str | None = None
    """The store's URL (e.g. "http://127.0.0.1:9000" for MinIO or moto); None: AWS, or AWS_ENDPOINT_URL."""

    region: str | None = None
    """The region name; None: boto3's (AWS_REGION, ~/.aws/config)."""

    profile: str | None = None
    """A profile of ~/.aws/credentials; None: boto3's default chain."""

    max_concurrency: int = 64
    """Concurrent GETs per loader actor, and its connection pool size."""

    retries: int = 5
    """Tries per request in all, on throttling (503 SlowDown), 5xx, connection errors and stalls (a try past
    `timeout_s`), with exponential backoff and jitter; never on 403 or 404."""

    timeout_s: float = 30.0
    """The most one try of a request may take, all of it: connect, headers and the whole body of the range
    (not one socket read: a store that drips bytes is cut off too). A try past it has its connection
    closed and is retried on a new one; all tries of a request end within `timeout_s * retries`."""

    def __post_init__(self) -> None:
        for name in ("endpoint_url", "region", "profile"):
            _name(name, getattr(self, name))
        positive_int("max_concurrency", self.max_concurrency)
        positive_int("retries", self.retries)
        check_number("timeout_s", self.timeout_s, above=0)


def _secret(name: str, value: object) -> None:
    """A non-empty string, or None; the error never shows the value (it is a credential)."""
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{name} must be a non-empty str or None (got a {type(value).__name__})")


def _request_bounds(options) -> None:
    positive_int("max_concurrency", options.max_concurrency)
    positive_int("retries", options.retries)
    check_number("timeout_s", options.timeout_s, above=0, finite=True)


@dataclass(frozen=True)
class GCSOptions:
    """How raydl talks to Google Cloud Storage (gs://bucket/key). Unset fields fall back to Google's
    application-default credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, the metadata server)
    and to STORAGE_EMULATOR_HOST, as Google's own client does."""

    endpoint_url: str | None = None
    """The store's URL (e.g. "http://127.0.0.1:4443" for fake-gcs-server); None: STORAGE_EMULATOR_HOST when
    set (with anonymous access, as Google's client), else storage.googleapis.com. A plain-HTTP endpoint is
    always read anonymously: no token is ever sent over an unencrypted connection."""

    anonymous: bool = False
    """Send no credentials (public buckets, emulators)."""

    project: str | None = None
    """The project billed for requester-pays buckets; None: the bucket's own."""

    credentials_file: str | None = None
    """A credentials JSON file (a service account's key, or an authorized user's); None: application-default
    credentials. Only its path is kept: raydl never copies, logs or prints its contents."""

    max_concurrency: int = 64
    """Concurrent requests per loader actor, and its connection pool size."""

    retries: int = 5
    """Tries per request in all, on throttling (429), 5xx, connection errors and stalls (a try past
    `timeout_s`), with exponential backoff and jitter; never on 403 or 404."""

    timeout_s: float = 30.0
    """The most one try of a request may take, all of it: connect, headers and the whole body (a store that
    drips bytes is cut off too). All tries of a request end within `timeout_s * retries` and the backoff
    waits between them."""

    def __post_init__(self) -> None:
        for name in ("endpoint_url", "project", "credentials_file"):
            _name(name, getattr(self, name))
        if not isinstance(self.anonymous, bool):
            raise ValueError(f"anonymous must be True or False, got {self.anonymous!r}")
        if self.anonymous and self.credentials_file is not None:
            raise ValueError("GCSOptions: anonymous=True sends no credentials; leave credentials_file unset")
        _request_bounds(self)


@dataclass(frozen=True)
class AzureOptions:
    """How raydl talks to Azure Blob Storage (az://container/key). Unset fields fall back to
    AZURE_STORAGE_CONNECTION_STRING, else to the account named here or in AZURE_STORAGE_ACCOUNT_NAME with
    Azure's default credential chain (a service principal's environment, workload identity, managed
    identity). The secrets (`connection_string`, `account_key`, `sas_token`) never appear in a repr, a log or
    an error."""

    connection_string: str | None = field(default=None, repr=False)
    """An Azure Storage connection string ("AccountName=...;AccountKey=...;BlobEndpoint=..." or with a
    SharedAccessSignature). Not with `account_name`, `account_key` or `sas_token`."""

    account_name: str | None = None
    """The storage account; None: the connection string's, or AZURE_STORAGE_ACCOUNT_NAME."""

    account_key: str | None = field(default=None, repr=False)
    """The account's shared key; None: no shared key (a SAS token, or the default credential chain)."""

    sas_token: str | None = field(default=None, repr=False)
    """A shared access signature ("sv=...&sig=...", with or without a leading "?")."""

    endpoint_url: str | None = None
    """The blob service's URL, with the account (e.g. "http://127.0.0.1:10000/devstoreaccount1" for
    azurite); None: https://ACCOUNT.blob.core.windows.net, or the connection string's BlobEndpoint."""

    max_concurrency: int = 64
    """Concurrent requests per loader actor, and its connection pool size."""

    retries: int = 5
    """Tries per request in all, on throttling (429, 503), 5xx, connection errors and stalls (a try past
    `timeout_s`), with exponential backoff and jitter; never on 403 or 404."""

    timeout_s: float = 30.0
    """The most one try of a request may take, all of it: connect, headers and the whole body (a store that
    drips bytes is cut off too). All tries of a request end within `timeout_s * retries` and the backoff
    waits between them."""

    def __post_init__(self) -> None:
        for name in ("connection_string", "account_key", "sas_token"):
            _secret(name, getattr(self, name))
        for name in ("account_name", "endpoint_url"):
            _name(name, getattr(self, name))
        if self.connection_string is not None:
            given = [n for n in ("account_name", "account_key", "sas_token") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"AzureOptions: connection_string names the account and its credential; leave "
                    f"{', '.join(given)} unset"
                )
        if self.account_key is not None and self.sas_token is not None:
            raise ValueError("AzureOptions: give account_key or sas_token, not both")
        _request_bounds(self)


def loader_config(options: dict[str, Any], *, caller: str) -> LoaderConfig:
    """The LoaderConfig of `caller`'s keywords; one that is not a field is a TypeError naming it."""
    known = [f.name for f in fields(LoaderConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword(s) {unknown}; it takes {known}")
    if "batch_size" not in options:
        raise TypeError(f"{caller} needs batch_size=")
    return LoaderConfig(**options)


def keyword_signature(method, config: type) -> inspect.Signature:
    """`method(self, *, <config's fields with their defaults>)`: what help() and editors show for a method
    that takes a config's fields as keywords, so that the fields are written once (in the config)."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in fields(config):
        default = inspect.Parameter.empty if f.default is MISSING else f.default
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type)
        )
    return inspect.Signature(params, return_annotation=inspect.signature(method).return_annotation)
