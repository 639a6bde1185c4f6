"""The public surface: exported names, LoaderConfig validation, and the error tree."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

import raydl
from raydl import errors
from raydl.config import LoaderConfig

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------ __all__ ----


def test_all_is_sorted_and_pinned():
    """raydl.__all__ is sorted and is exactly the current public API (change this test on purpose)."""
    assert raydl.__all__ == sorted(raydl.__all__)
    assert raydl.__all__ == ["AzureOptions", "Cache", "DataIterator", "Dataset", "GCSOptions", "IteratorStats", "Loader",
                            "S3Options", "errors", "mix", "read_images", "read_parquet", "read_tokens", "read_webdataset"]


def test_every_exported_name_exists():
    """Every name in __all__ (of raydl and raydl.errors) is an attribute of its module."""
    for module in (raydl, errors):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert errors.__all__ == sorted(errors.__all__)


def test_public_names_and_submodules_load_on_first_use():
    """`import raydl` is lazy: public names and submodules (raydl.config, ...) resolve on use; others raise."""
    assert raydl.Loader.__module__ == "raydl.execute.loader" and raydl.read_images.__module__ == "raydl.dataset"
    assert raydl.config.LoaderConfig is LoaderConfig and "errors" in dir(raydl)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        raydl.no_such_name  # noqa: B018


def test_the_coordinator_imports_none_of_the_workers_dependencies():
    """The coordinator actor's module loads without the worker, the decoders, pyarrow or the Dataset API."""
    import subprocess
    import sys

    heavy = ["raydl.actors.worker", "raydl.describe.transforms", "raydl.dataset", "PIL", "pyarrow", "pandas"]
    code = ("import sys, raydl.actors.coordinator, raydl.config; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --------------------------------------------------------- LoaderConfig ----


@pytest.mark.parametrize("field,value", [
    ("batch_size", 0), ("batch_size", -1), ("batch_size", True), ("batch_size", 2.0),
    ("world_size", 0), ("world_size", False),
    ("on_error", "bogus"),
    ("prefetch_batches", 0),
    ("seed", -1), ("seed", 2**63), ("seed", True), ("seed", 1.5),
    ("num_workers", 0), ("num_workers", -2),
    ("threads_per_worker", 0),
    ("io_concurrency", 0), ("io_concurrency", 1.5),
    ("cpus_per_worker", -0.5), ("cpus_per_worker", "1"),
])
def test_loader_config_rejects_bad_values_naming_the_parameter(field, value):
    """An invalid LoaderConfig field is a ValueError whose message names the field and shows the value."""
    kwargs = {"batch_size": 32, field: value}
    with pytest.raises(ValueError, match=field) as info:
        LoaderConfig(**kwargs)
    assert repr(value) in str(info.value)


def test_loader_config_defaults_and_frozen():
    """Valid configs build with the documented defaults and cannot be changed afterwards."""
    cfg = LoaderConfig(batch_size=256)
    assert (cfg.world_size, cfg.seed, cfg.shuffle, cfg.drop_last, cfg.on_error, cfg.num_workers,
            cfg.threads_per_worker, cfg.cpus_per_worker, cfg.node_resource, cfg.prefetch_batches,
            cfg.object_store_budget) == (1, 0, True, False, "skip", 1, None, 0.0, None, 2, None)
    LoaderConfig(batch_size=1, world_size=64, seed=2**63 - 1, on_error="raise", num_workers=3, cpus_per_worker=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 1  # type: ignore[misc]


def test_dataset_loader_names_every_loader_config_field():
    """Dataset.loader's docstring lists the keywords it takes: every LoaderConfig field, none missing."""
    doc = raydl.Dataset.loader.__doc__
    missing = [f.name for f in dataclasses.fields(LoaderConfig) if f"`{f.name}`" not in doc]
    assert not missing, missing


# ---------------------------------------------------------- error tree ----


def test_every_error_is_a_raydl_error():
    """Every exception in raydl.errors derives from RaydlError, itself an Exception."""
    assert issubclass(errors.RaydlError, Exception)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.RaydlError), name


def test_error_tree_matches_its_docstring():
    """The parents are the ones drawn in raydl.errors' docstring; BatchTimeoutError is also a TimeoutError."""
    assert errors.SampleDecodeError.__bases__ == (errors.DataSourceError,)
    assert errors.DataSourceError.__bases__ == (errors.RaydlError,)
    assert errors.NativeKernelError.__bases__ == (errors.RaydlError,)
    assert errors.LoaderError.__bases__ == (errors.RaydlError,)
    assert issubclass(errors.BatchTimeoutError, errors.LoaderError)
    assert issubclass(errors.BatchTimeoutError, TimeoutError)
    exc = errors.BatchTimeoutError("batch 3 of rank 1 late", rank=1, batch_index=3)
    assert isinstance(exc, TimeoutError) and (exc.rank, exc.batch_index) == (1, 3)


def test_sample_decode_error_survives_pickling():
    """SampleDecodeError keeps its message, uri and sample_id through pickle (as Ray sends it)."""
    exc = errors.SampleDecodeError("cannot decode /d/cat/1.jpg", uri="/d/cat/1.jpg", sample_id=42)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is errors.SampleDecodeError
    assert (str(back), back.uri, back.sample_id) == ("cannot decode /d/cat/1.jpg", "/d/cat/1.jpg", 42)


def test_data_source_error_survives_pickling():
    """DataSourceError keeps its message and uri through pickle."""
    back = pickle.loads(pickle.dumps(errors.DataSourceError("no root /x", uri="/x")))
    assert (type(back), str(back), back.uri) == (errors.DataSourceError, "no root /x", "/x")


def test_batch_timeout_error_survives_pickling():
    """BatchTimeoutError keeps its message, rank and batch_index through pickle (e.g. out of a Ray Train worker)."""
    back = pickle.loads(pickle.dumps(errors.BatchTimeoutError("late", rank=2, batch_index=9)))
    assert (type(back), str(back), back.rank, back.batch_index) == (errors.BatchTimeoutError, "late", 2, 9)
