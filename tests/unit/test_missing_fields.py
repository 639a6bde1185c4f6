"""A sample that lacks a selected field (no tar member, a null Parquet cell where the field needs a value) is
that sample's defect, as bytes that do not decode are: skipped and counted under on_error="skip", replaced
under "replace", raised under "raise" (MissingFieldError); a failed read keeps its own rule. No Ray: the
worker makes the batch and the rank's accounting settles it, as the iterator does."""
from __future__ import annotations

import io
import logging
import pickle
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.consume.accounting import Accounting
from raydl.consume.stats import IteratorStats
from raydl.describe.records import compile_pipeline
from raydl.errors import DataSourceError, MissingFieldError, SampleDecodeError
from raydl.plan.failures import ErrorPolicy, Failure
from raydl.plan.order import augmentation_seeds

pytestmark = pytest.mark.timeout(60)


def _tar(path, samples) -> str:
    """A tar shard of (key, {ext: bytes}) samples, members in order."""
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _laion(tmp_path, missing: int = 3) -> str:
    """8 LAION-style samples (jpg, txt, cls); sample `missing` has no .txt member."""
    samples = []
    for i in range(8):
        fields = {"jpg": b"jpeg-%d" % i, "txt": b"a photo of %d" % i, "cls": b"%d" % i}
        if i == missing:
            del fields["txt"]
        samples.append((f"k{i}", fields))
    return _tar(tmp_path / "laion.tar", samples)


def _batch(ds, ids, on_error, *, index=0):
    pipe = compile_pipeline(ds.stages)
    spec = WorkerSpec(program=pipe.program, threads=2, on_error=on_error, sample_stages=pipe.sample_stages)
    ids = np.asarray(ids, np.int64)
    task = BatchTask(rank=0, epoch=0, index=index, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))
    return LoaderWorker(spec, ds.catalog, reuse_buffers=False).run_batch(task)


def _settle(result, on_error, *, batch=0):
    """What the rank's iterator does with a batch's failures: its stats after them (or the error it raises)."""
    stats = IteratorStats(rank=0)
    Accounting(ErrorPolicy(on_error), stats, rank=0).batch(result, batch, 0)
    return stats


def test_a_missing_tar_member_is_skipped_under_the_default(tmp_path, caplog):
    """on_error="skip" (the default): a sample with no .txt member for the selected caption is left out of its
    batch, counted and logged once naming the shard, the sample and the field; the epoch goes on (it raised a
    DataSourceError as if the shard could not be read)."""
    path = _laion(tmp_path)
    ds = raydl.read_webdataset(path, fields={"image": "jpg", "caption": "txt"})
    result = _batch(ds, range(8), "skip")
    assert result.batch["key"] == [f"k{i}" for i in range(8) if i != 3]
    assert result.batch["caption"].tolist() == [f"a photo of {i}" for i in range(8) if i != 3]
    with caplog.at_level(logging.WARNING, logger="raydl.consume.iterator"):
        stats = _settle(result, "skip", batch=1)
    assert stats.samples_skipped == 1 and stats.skipped_uris == [f"{path}#k3"]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == (
        f"raydl: skipped sample 3 ({path}#k3): {path}: sample 'k3' lacks the field 'caption' (no .txt member)"
    )


def test_a_missing_tar_member_is_replaced_or_raised_as_on_error_says(tmp_path):
    """"replace": a substitute stands in and the batch stays full; "raise": MissingFieldError (a
    SampleDecodeError, a DataSourceError) naming the rank, batch, sample, field and shard."""
    path = _laion(tmp_path)
    ds = raydl.read_webdataset(path, fields={"image": "jpg", "caption": "txt"})
    replaced = _batch(ds, range(8), "replace")
    assert len(replaced.batch["key"]) == 8 and "k3" not in replaced.batch["key"]
    (r,) = replaced.replaced
    assert r.sample_id == 3 and r.uri == f"{path}#k3" and "lacks the field 'caption'" in r.reason
    assert _settle(replaced, "replace").samples_replaced == 1

    raised = _batch(ds, range(8), "raise")
    with pytest.raises(MissingFieldError) as info:
        _settle(raised, "raise", batch=1)
    err = info.value
    assert isinstance(err, SampleDecodeError) and isinstance(err, DataSourceError)
    assert (err.uri, err.sample_id) == (f"{path}#k3", 3)
    assert str(err) == (
        f"rank 0: batch 1 of epoch 0: incomplete sample 3 ({path}#k3): {path}: sample 'k3' lacks the field "
        "'caption' (no .txt member)"
    )
    again = pickle.loads(pickle.dumps(err))  # as Ray sends it to the driver
    assert type(again) is MissingFieldError and (again.uri, again.sample_id, str(again)) == (
        err.uri, err.sample_id, str(err))


def test_a_failed_read_still_stops_the_epoch_under_skip(tmp_path):
    """The rule for reads is unchanged: a sample whose shard cannot be read is raised under "skip", and a
    missing field beside it does not hide it."""
    path = _laion(tmp_path)
    ds = raydl.read_webdataset(path, fields={"image": "jpg", "caption": "txt"})
    (tmp_path / "laion.tar").write_bytes(b"")  # the shard's bytes are gone since listing
    raydl.sources.webdataset.clear_blocks()
    result = _batch(ds, [3, 5], "skip")
    with pytest.raises(DataSourceError, match="cannot read sample") as info:
        _settle(result, "skip")
    assert not isinstance(info.value, MissingFieldError)


def test_the_policy_table_for_a_missing_field():
    """ErrorPolicy: a "field" failure follows on_error as a decode failure does; source_failed tells a missing
    field (named by the sample) from a failed read (named by the error's object)."""
    missing = MissingFieldError("s.tar: sample 'k' lacks the field 'txt' (no .txt member)", uri="s.tar")
    field = Failure.source_failed(4, "s.tar", "s.tar#k", missing)
    assert (field.step, field.uri, field.error, field.unreadable) == ("field", "s.tar#k", MissingFieldError, True)
    assert [ErrorPolicy(m).action(field) for m in ("skip", "replace", "raise")] == ["skip", "replace", "raise"]
    read = Failure.source_failed(4, "s.tar", "s.tar#k", DataSourceError("gone", uri="s.tar"))
    assert (read.step, read.uri) == ("read", "s.tar")
    assert [ErrorPolicy(m).action(read) for m in ("skip", "replace", "raise")] == ["raise", "replace", "raise"]


def test_a_null_parquet_array_cell_is_skipped_under_the_default(tmp_path):
    """A Parquet row whose fixed-size-list (array) cell is null is left out under "skip", counted, and raised
    as MissingFieldError naming the file, row, field and column under "raise"."""
    emb = pa.array([[float(i)] * 4 if i != 2 else None for i in range(6)], pa.list_(pa.float32(), 4))
    pq.write_table(pa.table({"emb": emb, "n": list(range(6))}), tmp_path / "t.parquet", row_group_size=3)
    ds = raydl.read_parquet(str(tmp_path / "t.parquet"))
    result = _batch(ds, range(6), "skip")
    assert result.batch["n"].tolist() == [0, 1, 3, 4, 5] and result.batch["emb"].shape == (5, 4)
    stats = _settle(result, "skip")
    assert stats.samples_skipped == 1 and stats.skipped_uris == [f"{tmp_path}/t.parquet#0:2"]
    with pytest.raises(MissingFieldError, match=r"incomplete sample 2 \(.*t.parquet#0:2\): .*field 'emb' "
                                                r"\(column 'emb'\) is null; an array field needs a value"):
        _settle(_batch(ds, range(6), "raise"), "raise")


def test_a_label_member_that_is_not_an_integer_is_the_samples_defect(tmp_path):
    """read_webdataset's image and label: a .cls member that is not an integer is a field that does not decode,
    skipped under "skip" (it was raised as a failed read)."""
    samples = [(f"k{i}", {"jpg": b"jpeg-%d" % i, "cls": b"%d" % i if i != 2 else b"cat"}) for i in range(4)]
    path = _tar(tmp_path / "labels.tar", samples)
    result = _batch(raydl.read_webdataset(path), range(4), "skip")
    assert result.batch["key"] == ["k0", "k1", "k3"] and result.batch["label"].tolist() == [0, 1, 3]
    stats = _settle(result, "skip")
    assert stats.samples_skipped == 1 and stats.skipped_uris == [f"{path}#k2"]
    with pytest.raises(SampleDecodeError, match=r"cannot decode sample 2 .*'cls' member b'cat' that is not an "
                                                r"integer label"):
        _settle(_batch(raydl.read_webdataset(path), range(4), "raise"), "raise")


def test_a_label_member_too_large_to_be_one_is_the_samples_defect(tmp_path):
    """read_webdataset's image and label: a .cls member past MAX_LABEL_BYTES (found from the index, before any
    read) is left out under "skip" and counted, as a label that does not decode is (it was raised as a failed
    read), replaced under "replace", and raised naming the sample and its size under "raise"."""
    from raydl.sources._wds_source import MAX_LABEL_BYTES

    big = b"7" * (MAX_LABEL_BYTES + 1)
    samples = [(f"k{i}", {"jpg": b"jpeg-%d" % i, "cls": b"%d" % i if i != 1 else big}) for i in range(4)]
    path = _tar(tmp_path / "big-label.tar", samples)
    result = _batch(raydl.read_webdataset(path), range(4), "skip")
    assert result.batch["key"] == ["k0", "k2", "k3"] and result.batch["label"].tolist() == [0, 2, 3]
    stats = _settle(result, "skip")
    assert stats.samples_skipped == 1 and stats.skipped_uris == [f"{path}#k1"]
    replaced = _batch(raydl.read_webdataset(path), range(4), "replace")
    assert len(replaced.batch["key"]) == 4 and "k1" not in replaced.batch["key"]
    with pytest.raises(SampleDecodeError, match=rf"sample 'k1' has a {MAX_LABEL_BYTES + 1}-byte 'cls' member at "
                                                r"offset \d+, not an integer label"):
        _settle(_batch(raydl.read_webdataset(path), range(4), "raise"), "raise")
