"""Batch formats (raydl/consume/formats.py) and torch batches (raydl/consume/torch.py) on hand-made numpy
batches shaped as the workers make them: every kind of column, zero-copy where promised, the errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from raydl.consume.formats import check_batch_format, format_batches, to_pandas, to_pyarrow
from raydl.consume.torch import check_torch_args, torch_batches

pytestmark = pytest.mark.timeout(60)


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)  # np.array would stack equal-length rows
    for i, v in enumerate(values):
        out[i] = v
    return out


def _batch(bucket=None) -> dict:
    """Three samples with one column of each kind a worker makes, read-only as the object store's are."""
    image = np.arange(3 * 4 * 5 * 3, dtype=np.uint8).reshape(3, 4, 5, 3)
    batch = {
        "image": image,
        "normalized": np.linspace(0, 1, 3 * 3 * 2 * 2, dtype=np.float32).reshape(3, 3, 2, 2),
        "mask": (image[..., 0] % 3).astype(np.uint8),
        "npy": np.arange(18, dtype=np.float64).reshape(3, 2, 3),
        "label": np.array([7, -1, 2], np.int64),
        "score": np.array([0.5, 1.5, 2.5], np.float32),
        "flag": np.array([True, False, True]),
        "tokens": _objects([np.arange(4, dtype=np.int32), np.arange(2, dtype=np.int32), None]),
        "caption": _objects(["a cat", "ünïcode", None]),
        "meta": _objects([{"w": 1, "src": "x"}, {"w": 2, "src": "y"}, {"w": 3, "src": "z"}]),
        "raw": _objects([b"\x00\x01", b"", b"zz"]),
        "nothing": _objects([None, None, None]),
        "id": np.array([10, 11, 12], np.int64),
        "key": ["s/0", "s/1", "s/2"],
    }
    for v in batch.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    if bucket is not None:
        batch["bucket"] = bucket
    return batch


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ------------------------------------------------------------------------------------------ formats ----


def test_known_formats_and_the_errors():
    """"default" is numpy; an unknown format lists the known ones; a collate_fn must be callable."""
    assert check_batch_format("default") == "numpy" and check_batch_format("pyarrow") == "pyarrow"
    with pytest.raises(ValueError, match=r"batch_format must be one of 'numpy', 'pyarrow', 'pandas'.*'torch'"):
        check_batch_format("torch")
    with pytest.raises(TypeError, match="collate_fn must be a callable"):
        check_batch_format("numpy", collate_fn="stack")


def test_numpy_batches_pass_through_and_collate_fn_gets_the_formatted_batch():
    """numpy is the worker's batch itself; collate_fn gets the batch in the asked format, and what it returns
    is yielded as it is."""
    batch = _batch()
    (same,) = format_batches(iter([batch]), "numpy")
    assert same is batch
    (got,) = format_batches(iter([batch]), "numpy", collate_fn=lambda b: ("mine", b))
    assert got == ("mine", batch)
    (table,) = format_batches(iter([batch]), "pyarrow", collate_fn=lambda t: t)
    assert isinstance(table, pa.Table) and table.num_rows == 3


def test_pyarrow_columns_of_every_kind():
    """Numbers stay numbers, (B, ...) arrays become fixed-shape tensors, token arrays list<int32>, text string,
    dicts struct, bytes binary, None null; key is a string column, bucket the schema's metadata."""
    batch = _batch(bucket=(224, 160))
    table = to_pyarrow(batch)
    assert table.column_names == [k for k in batch if k != "bucket"]
    col = {name: table.column(name).combine_chunks() for name in table.column_names}
    for name in ("image", "normalized", "mask", "npy"):
        assert col[name].type.shape == list(batch[name].shape[1:]), name
        np.testing.assert_array_equal(col[name].to_numpy_ndarray(), batch[name])
    assert col["label"].type == pa.int64() and col["label"].to_pylist() == [7, -1, 2]
    assert col["score"].type == pa.float32() and col["flag"].to_pylist() == [True, False, True]
    assert col["tokens"].type == pa.list_(pa.int32())
    assert col["tokens"].to_pylist() == [[0, 1, 2, 3], [0, 1], None]
    assert col["caption"].type == pa.string() and col["caption"].to_pylist() == ["a cat", "ünïcode", None]
    assert pa.types.is_struct(col["meta"].type) and col["meta"].to_pylist()[2] == {"w": 3, "src": "z"}
    assert col["raw"].type == pa.binary() and col["raw"].to_pylist() == [b"\x00\x01", b"", b"zz"]
    assert col["nothing"].type == pa.null() and col["nothing"].null_count == 3
    assert col["key"].type == pa.string() and col["key"].to_pylist() == batch["key"]
    assert json.loads(table.schema.metadata[b"bucket"]) == [224, 160]
    assert b"bucket" not in (to_pyarrow(_batch()).schema.metadata or {})


def test_pyarrow_numbers_and_tensors_are_views_of_the_batch():
    """Numeric and fixed-shape columns point at the numpy arrays' own memory (no copy); only a non-contiguous
    array is copied."""
    batch = _batch()
    table = to_pyarrow(batch)
    for name in ("image", "normalized", "mask", "npy"):
        values = table.column(name).chunk(0).storage.values
        assert values.buffers()[1].address == _address(batch[name]), name
    for name in ("label", "score"):
        assert table.column(name).chunk(0).buffers()[1].address == _address(batch[name]), name
    strided = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    assert to_pyarrow({"x": strided, "id": batch["id"]}).column("x").combine_chunks().to_numpy_ndarray().tolist() == (
        strided.tolist()
    )


def test_pyarrow_without_dict_columns_never_imports_pandas():
    """Converting a batch of images, numbers, tokens and text leaves pandas unimported (pa.array would import
    it: about a second)."""
    code = """
import sys, numpy as np
from raydl.consume.formats import to_pyarrow
tokens = np.empty(2, object); tokens[0] = np.arange(3); tokens[1] = np.arange(1)
text = np.empty(2, object); text[:] = ["a", None]
t = to_pyarrow({"image": np.zeros((2, 4, 4, 3), np.uint8), "tokens": tokens, "caption": text,
                "flag": np.array([True, False]), "id": np.arange(2), "key": ["a", "b"]})
assert t.num_rows == 2
print("pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_empty_batches_keep_their_columns():
    """A batch whose every sample was skipped (0 rows) still converts, with its columns and shapes."""
    batch = {
        "image": np.zeros((0, 4, 5, 3), np.uint8),
        "label": np.zeros(0, np.int64),
        "caption": np.empty(0, dtype=object),
        "id": np.zeros(0, np.int64),
        "key": [],
    }
    table = to_pyarrow(batch)
    assert table.num_rows == 0 and table.column("image").type.shape == [4, 5, 3]
    assert table.column_names == list(batch)
    df = to_pandas(batch)
    assert len(df) == 0 and list(df.columns) == list(batch)


def test_a_column_of_another_length_or_not_an_array_is_named():
    """A batch whose columns disagree on their row count (a user's map_batches, say) is a ValueError naming the
    column; so is a value that is not one per row, and a column Arrow cannot hold."""
    with pytest.raises(ValueError, match=r"batch column 'caption' has 2 rows, the batch 3"):
        to_pyarrow({"id": np.arange(3), "caption": ["a", "b"]})
    with pytest.raises(ValueError, match=r"batch column 'size' is a int, not one value per row"):
        to_pandas({"id": np.arange(3), "size": 7})
    with pytest.raises(ValueError, match=r"column 'z' cannot be an Arrow column"):
        to_pyarrow({"id": np.arange(2), "z": np.array([1j, 2j])})


def test_pandas_columns_of_every_kind():
    """A DataFrame: numbers as columns, (B, ...) arrays as per-row views, object columns the same Python
    values (dtype object), bucket in df.attrs."""
    batch = _batch(bucket=(224, 160))
    df = to_pandas(batch)
    assert list(df.columns) == [k for k in batch if k != "bucket"] and len(df) == 3
    assert df["label"].dtype == np.int64 and df["label"].tolist() == [7, -1, 2]
    for name in ("image", "mask", "npy"):
        assert df[name][1].shape == batch[name].shape[1:]
        assert np.shares_memory(df[name][1], batch[name]), name  # a view of the row, not a copy
    assert df["tokens"][0] is batch["tokens"][0] and df["tokens"][2] is None
    assert df["meta"][1] is batch["meta"][1] and df["caption"].dtype == object
    assert df["key"].tolist() == batch["key"] and df["raw"][0] == b"\x00\x01"
    assert df.attrs["bucket"] == (224, 160)


# -------------------------------------------------------------------------------------------- torch ----


def test_collate_fn_with_dtypes_device_or_pin_memory_is_refused():
    """As Ray Data: collate_fn's output is yielded as it is, so dtypes, device and pin_memory beside it are a
    ValueError saying so (checked without torch)."""
    def mine(batch):
        return batch

    check_torch_args(collate_fn=mine, dtypes=None, device="auto", pin_memory=False)
    for extra in ({"dtypes": "float16"}, {"device": "cpu"}, {"pin_memory": True}):
        args = {"dtypes": None, "device": "auto", "pin_memory": False, **extra}
        with pytest.raises(ValueError, match="collate_fn cannot be used with dtypes, device or pin_memory"):
            check_torch_args(collate_fn=mine, **args)


def test_torch_columns_of_every_kind():
    """Numeric columns are tensors sharing the batch's memory; token arrays a list of tensors (each a view);
    text, dicts, bytes and None stay Python lists; key and bucket pass through."""
    torch = pytest.importorskip("torch")
    batch = _batch(bucket=(4, 5))
    (out,) = torch_batches(iter([batch]))
    for name in ("image", "normalized", "mask", "npy", "label", "score", "flag", "id"):
        assert isinstance(out[name], torch.Tensor), name
        assert out[name].data_ptr() == _address(batch[name]), name  # zero-copy
        np.testing.assert_array_equal(out[name].numpy(), batch[name])
    assert out["label"].dtype == torch.int64 and out["flag"].dtype == torch.bool
    assert [t.tolist() for t in out["tokens"][:2]] == [[0, 1, 2, 3], [0, 1]] and out["tokens"][2] is None
    assert out["tokens"][0].data_ptr() == _address(batch["tokens"][0])
    assert out["caption"] == ["a cat", "ünïcode", None] and out["meta"][0] == {"w": 1, "src": "x"}
    assert out["raw"] == [b"\x00\x01", b"", b"zz"] and out["nothing"] == [None, None, None]
    assert out["key"] == batch["key"] and out["bucket"] == (4, 5)


def test_torch_dtypes():
    """One dtype converts the image columns (not masks, labels or ids); a dict converts the columns it names,
    each tensor of a token column included; naming a text column is a ValueError."""
    torch = pytest.importorskip("torch")
    (out,) = torch_batches(iter([_batch()]), dtypes=torch.float16, images=("image", "normalized"))
    assert out["image"].dtype == out["normalized"].dtype == torch.float16
    assert out["mask"].dtype == torch.uint8 and out["label"].dtype == torch.int64
    (out,) = torch_batches(iter([_batch()]), dtypes={"label": torch.int32, "tokens": torch.int64})
    assert out["label"].dtype == torch.int32 and out["image"].dtype == torch.uint8
    assert out["tokens"][0].dtype == torch.int64
    with pytest.raises(ValueError, match=r"dtypes names column 'caption', which holds NoneType/str values"):
        next(torch_batches(iter([_batch()]), dtypes={"caption": torch.float32}))
    with pytest.raises(TypeError, match="dtypes must be a torch.dtype"):
        check_torch_args(collate_fn=None, dtypes="float16", device="auto", pin_memory=False)


def test_torch_devices():
    """device="auto" is the CPU; CUDA and pinned memory land on the GPU where one exists, and say that they need
    one where none does."""
    torch = pytest.importorskip("torch")
    (out,) = torch_batches(iter([_batch()]), device="auto")
    assert out["image"].device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            check_torch_args(collate_fn=None, dtypes=None, device="cuda", pin_memory=False)
        with pytest.raises(RuntimeError, match="pin_memory=True needs a CUDA device"):
            check_torch_args(collate_fn=None, dtypes=None, device="auto", pin_memory=True)
        pytest.skip("no CUDA device on this machine: the GPU half of this test did not run")
    (out,) = torch_batches(iter([_batch()]), device="cuda", pin_memory=True, dtypes={"tokens": torch.int64})
    assert out["image"].is_cuda and out["tokens"][0].is_cuda and out["caption"][0] == "a cat"
    np.testing.assert_array_equal(out["image"].cpu().numpy(), _batch()["image"])
