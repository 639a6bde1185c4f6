"""The error policy without Ray: what becomes of a failed sample under each on_error, and the errors it builds."""
from __future__ import annotations

import pickle

import pytest

from raydl import errors
from raydl.options import LoaderConfig
from raydl.plan.failures import ErrorPolicy, Failure

DECODE = Failure.decode_failed(5, "file:///d/a.jpg", errors.DecodeError("corrupt JPEG"), worker="w")
READ = Failure.read_failed(6, "file:///d/b.jpg", errors.DataSourceError("gone since listing"))
CHANGED = Failure.read_failed(7, "s3://b/c.jpg", errors.ObjectChangedError("etag changed", uri="s3://b/c.jpg"))
DENIED = Failure.read_failed(8, "s3://b/d.jpg", errors.AccessDeniedError("403", uri="s3://b/d.jpg"))
UNSIZED = Failure.unsized(9, "file:///d/e.jpg", "no image size in the catalog")

# failure -> the action under (skip, replace, raise)
TABLE = [
    (DECODE, ("skip", "replace", "raise")),
    (READ, ("raise", "replace", "raise")),
    (CHANGED, ("raise", "raise", "raise")),
    (DENIED, ("raise", "raise", "raise")),
    (UNSIZED, ("skip", "skip", "raise")),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("failure,actions", TABLE, ids=["decode", "read", "changed", "denied", "size"])
def test_action_follows_on_error_and_the_failure(failure, actions):
    """Each failure's action under skip, replace and raise is the module's table."""
    assert tuple(ErrorPolicy(mode).action(failure) for mode in ("skip", "replace", "raise")) == actions


@pytest.mark.timeout(10)
def test_read_failed_keeps_the_error_type_and_names_the_errors_uri():
    """A failed read keeps the error's type for the iterator and is named by the error's URI, else the sample's."""
    assert (CHANGED.step, CHANGED.error, CHANGED.uri, CHANGED.unreadable) == ("read", errors.ObjectChangedError, "s3://b/c.jpg", True)
    assert (READ.uri, READ.error, READ.reason) == ("file:///d/b.jpg", errors.DataSourceError, "gone since listing")
    assert not DECODE.unreadable and not UNSIZED.unreadable


@pytest.mark.timeout(10)
def test_an_error_other_than_a_decode_error_is_no_samples_fault():
    """decode_failed raises anything but a errors.DecodeError as a errors.LoaderError naming the sample and the worker."""
    cause = MemoryError("cannot allocate the decode buffer")
    with pytest.raises(errors.LoaderError) as info:
        Failure.decode_failed(3, "file:///d/x.png", cause, worker="raydl-worker-1")
    assert str(info.value) == (
        "loader worker raydl-worker-1: sample 3 (file:///d/x.png) failed with MemoryError: cannot allocate "
        "the decode buffer (not a decode error: on_error does not cover it)"
    )
    assert info.value.__cause__ is cause and not isinstance(info.value, errors.SampleDecodeError)


@pytest.mark.timeout(10)
def test_unreadable_error_has_the_workers_type_and_counts_only_reads():
    """The iterator's error for unreadable samples: the worker-seen type, rank/batch/epoch, and '(and N more)'
    counting the other unreadable samples only."""
    err = ErrorPolicy("skip").error([CHANGED, READ, DECODE], rank=1, epoch=3, batch=2)
    assert type(err) is errors.ObjectChangedError and err.uri == "s3://b/c.jpg"
    assert str(err) == "rank 1: batch 2 of epoch 3: cannot read sample 7 (s3://b/c.jpg): etag changed (and 1 more)"
    alone = ErrorPolicy("skip").error([READ], rank=0, epoch=0, batch=4)
    assert type(alone) is errors.DataSourceError
    assert str(alone) == "rank 0: batch 4 of epoch 0: cannot read sample 6 (file:///d/b.jpg): gone since listing"


@pytest.mark.timeout(10)
def test_decode_and_bucket_errors_are_sample_decode_errors_naming_the_sample():
    """on_error='raise': an undecodable sample names the rank; one in no bucket names how many more are."""
    err = ErrorPolicy("raise").error([DECODE, DECODE], rank=2, epoch=0, batch=1)
    assert isinstance(err, errors.SampleDecodeError) and (err.uri, err.sample_id) == ("file:///d/a.jpg", 5)
    assert str(err) == "rank 2: cannot decode sample 5 (file:///d/a.jpg): corrupt JPEG"
    other = Failure.unsized(10, "file:///d/f.jpg", "truncated header")
    err = ErrorPolicy("raise").error([UNSIZED, other])
    assert isinstance(err, errors.SampleDecodeError) and (err.uri, err.sample_id) == ("file:///d/e.jpg", 9)
    assert str(err) == "cannot bucket sample 9 (file:///d/e.jpg): no image size in the catalog (and 1 more)"


@pytest.mark.timeout(10)
def test_settle_returns_the_skipped_or_raises_the_first_to_raise():
    """settle: every failure back when none is to be raised; else the error naming the first to raise."""
    assert ErrorPolicy("skip").settle([DECODE, UNSIZED]) == [DECODE, UNSIZED]
    assert ErrorPolicy("replace").settle((UNSIZED,)) == [UNSIZED]
    assert ErrorPolicy("raise").settle([]) == []
    with pytest.raises(errors.SampleDecodeError, match="cannot decode sample 5"):
        ErrorPolicy("raise").settle([DECODE], rank=0, epoch=0, batch=0)
    with pytest.raises(errors.DataSourceError, match="batch 3 of epoch 1: cannot read sample 6"):
        ErrorPolicy("skip").settle([DECODE, READ], rank=0, epoch=1, batch=3)  # the decode failure is skippable


@pytest.mark.timeout(10)
def test_settle_raises_a_failure_to_replace_that_was_not_replaced():
    """Under 'replace' a failure that reaches settle was not substituted: it is raised, never left out silently."""
    with pytest.raises(errors.DataSourceError, match=r"cannot read sample 6 .*\(and 1 more\)"):
        ErrorPolicy("replace").settle([READ, CHANGED], rank=0, epoch=0, batch=0)
    with pytest.raises(errors.SampleDecodeError, match="cannot decode sample 5"):
        ErrorPolicy("replace").settle([DECODE], rank=0, epoch=0, batch=0)


@pytest.mark.timeout(10)
def test_no_substitute_error_names_the_sample_and_its_substitutes():
    """under 'replace', a sample none of whose substitutes decodes fails the batch naming them all."""
    err = ErrorPolicy("replace").no_substitute(DECODE, [11, 12])
    assert isinstance(err, errors.SampleDecodeError) and (err.uri, err.sample_id) == ("file:///d/a.jpg", 5)
    assert str(err) == (
        "sample 5 (file:///d/a.jpg) failed (corrupt JPEG) and none of its substitutes [11, 12] could be "
        "decoded either; is most of the data bad?"
    )


@pytest.mark.timeout(10)
def test_policy_refuses_an_unknown_mode_as_loader_config_does():
    """An on_error outside ON_ERROR is the ValueError LoaderConfig raises, word for word."""
    with pytest.raises(ValueError) as mine:
        ErrorPolicy("ignore")
    with pytest.raises(ValueError) as config:
        LoaderConfig(batch_size=1, on_error="ignore")
    assert str(mine.value) == str(config.value)


@pytest.mark.timeout(10)
def test_failures_survive_pickling():
    """Failures cross Ray from worker to iterator: a pickled one is equal and keeps its error type."""
    for failure in (DECODE, CHANGED, DENIED, UNSIZED):
        again = pickle.loads(pickle.dumps(failure))
        assert again == failure and ErrorPolicy("replace").action(again) == ErrorPolicy("replace").action(failure)
