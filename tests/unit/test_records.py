"""Samples as records: fields batched by kind, the user's map / map_batches / pad in the worker, no decode."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.batch.collate import collate
from raydl.describe.records import compile_pipeline
from raydl.errors import LoaderError
from raydl.plan.order import augmentation_seeds
from raydl.sources.base import Field

pytestmark = pytest.mark.timeout(60)


def _run(ds, ids, *, epoch=0, k=0, on_error="skip"):
    """One batch of `ids` made by a LoaderWorker in this process (no Ray)."""
    pipe = compile_pipeline(ds.stages)
    spec = WorkerSpec(program=pipe.program, threads=2, on_error=on_error, sample_stages=pipe.sample_stages,
                      batch_stages=pipe.batch_stages)
    worker = LoaderWorker(spec, ds.catalog, reuse_buffers=False)
    ids = np.asarray(ids, np.int64)
    task = BatchTask(rank=0, epoch=epoch, index=k, ids=ids, seeds=augmentation_seeds(ids, seed=3, epoch=epoch))
    return worker.run_batch(task).batch


def _uri(row):
    return f"sample-{row}"


def test_values_are_stacked_by_kind_and_kept_as_objects_otherwise():
    """Numbers stack (ints int64, numpy scalars keep their dtype); text, dicts, bytes and None are object arrays;
    list fields stack where their lengths agree and are object arrays of arrays where not."""
    assert collate(Field("n"), [1, 2, 3], _uri).dtype == np.int64
    assert collate(Field("f"), [np.float32(1), np.float32(2)], _uri).dtype == np.float32
    assert collate(Field("x"), [0.5, 1], _uri).dtype == np.float64
    text = collate(Field("t"), ["a", "bc"], _uri)
    assert text.dtype == object and text.tolist() == ["a", "bc"]
    meta = collate(Field("m"), [{"a": [1, 2]}, None], _uri)
    assert meta.dtype == object and meta[0] == {"a": [1, 2]} and meta[1] is None
    same = collate(Field("ids", "list"), [np.arange(4, dtype=np.int32)] * 3, _uri)
    assert same.shape == (3, 4) and same.dtype == np.int32
    ragged = collate(Field("ids", "list"), [np.arange(2), np.arange(5)], _uri)
    assert ragged.dtype == object and [len(a) for a in ragged] == [2, 5]
    assert collate(Field("label", "value", "int64"), [], _uri).dtype == np.int64


def test_an_array_field_of_two_shapes_in_one_batch_names_the_field_both_shapes_and_samples():
    """Without pad, a batch cannot stack (3,) and (4,): the error says which field, which shapes, which samples."""
    with pytest.raises(LoaderError, match=r"field 'emb' has shape \(3,\) in sample-0 and \(4,\) in sample-1.*\.pad"):
        collate(Field("emb", "array"), [np.zeros(3), np.zeros(4)], _uri)


def _tokens(record, rng):
    n = int(rng.integers(1, 12))
    return {**record, "tokens": rng.integers(0, 1000, n).astype(np.int32), "side": int(record["label"]) * 10}


def test_map_with_rng_is_deterministic_and_pad_fixes_the_length(image_folder):
    """A map with `rng` draws the same numbers for the same sample and epoch (and others in another epoch);
    pad truncates or pads to the length and says how many values are the sample's own."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(8).map(_tokens).pad("tokens", 6, value=-1)
    a, b = _run(ds, range(10)), _run(ds, range(10))
    assert a["tokens"].shape == (10, 6) and a["tokens"].dtype == np.int32
    assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["tokens_length"], b["tokens_length"])
    assert a["image"].shape == (10, 8, 8, 3)
    assert np.array_equal(a["side"], a["label"] * 10)
    for row, n in enumerate(a["tokens_length"]):
        assert 1 <= n <= 6 and np.all(a["tokens"][row, n:] == -1)
    other = _run(ds, range(10), epoch=1)
    assert not np.array_equal(other["tokens"], a["tokens"])


def _shift(batch, rng):
    return {**batch, "noise": rng.normal(size=len(batch["id"])).astype(np.float32), "image": batch["image"] // 2}


def test_map_batches_runs_on_the_numpy_batch_with_a_seeded_rng(image_folder):
    """map_batches sees the whole numpy batch; its rng is a function of the batch's seeds."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(8)
    plain = _run(ds, range(6))
    a, b = _run(ds.map_batches(_shift), range(6)), _run(ds.map_batches(_shift), range(6))
    assert np.array_equal(a["image"], plain["image"] // 2)
    assert np.array_equal(a["noise"], b["noise"]) and a["noise"].shape == (6,)
    assert a["key"] == plain["key"] and np.array_equal(a["id"], plain["id"])


def _boom(record):
    if record["label"] >= 0:
        raise ZeroDivisionError("tokenizer broke")
    return record


def test_an_exception_in_map_fails_the_batch_naming_the_sample_and_the_worker_with_the_traceback(image_folder):
    """A bug in the user's map is a LoaderError (never skipped, whatever on_error), with the original traceback."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(8).map(_boom)
    with pytest.raises(LoaderError, match=r"(?s)\.map\(_boom\) raised on sample \d+ \(.*\): ZeroDivisionError: "
                       r"tokenizer broke.*on_error does not cover it.*Traceback.*in _boom"):
        _run(ds, range(4), on_error="skip")


def test_an_unpicklable_function_is_a_value_error_at_loader(image_folder):
    """A fn holding a lock cannot reach the workers: loader() refuses it before any actor starts."""
    lock = threading.Lock()
    ds = raydl.read_images(str(image_folder)).decode().center_crop(8).map(lambda r: {**r, "lock": lock})
    with pytest.raises(ValueError, match="cannot be pickled"):
        ds.loader(batch_size=4)


def test_without_decode_image_fields_are_their_bytes(image_folder):
    """No .decode(): the image field comes out as each file's bytes (an object array)."""
    ds = raydl.read_images(str(image_folder))
    batch = _run(ds, range(3))
    files = sorted(p for p in image_folder.rglob("*") if p.is_file())
    assert batch["image"].dtype == object
    assert [bytes(x) for x in batch["image"]] == [p.read_bytes() for p in files[:3]]


def test_python_stages_come_after_the_native_ones():
    """A native stage after map, or map after map_batches, is refused at the call that makes the mistake."""
    from raydl.describe.records import Map, MapBatches, check_pipeline_order
    from raydl.describe.transforms import CenterCrop, Decode

    with pytest.raises(ValueError, match=r"\.center_crop\(\) cannot follow \.map\(\)"):
        check_pipeline_order((Decode(), Map(dict), CenterCrop(8)))
    with pytest.raises(ValueError, match=r"\.map\(\) cannot follow \.map_batches\(\)"):
        check_pipeline_order((MapBatches(dict), Map(dict)))
    check_pipeline_order((Map(dict),))  # no decode needed for a source without images


def _caption(record, rng):
    return {**record, "caption": f"class {record['label']} #{int(rng.integers(100))}"}


def test_a_replaced_sample_brings_its_own_fields_through_the_users_map(tmp_path):
    """on_error="replace": the substitute's record goes through map too, so its caption is its own."""
    from raydl.demo import make_images

    make_images(str(tmp_path), 12, classes=3, seed=2, corrupt=1)
    ds = raydl.read_images(str(tmp_path)).decode().center_crop(8).map(_caption)
    batch = _run(ds, range(len(ds)), on_error="replace")
    assert len(batch["id"]) == len(ds) and batch["caption"].dtype == object
    assert len(set(batch["id"].tolist())) < len(ds)  # the corrupt one's slot holds a substitute
    for label, caption in zip(batch["label"], batch["caption"], strict=True):
        assert caption.startswith(f"class {label} #")
