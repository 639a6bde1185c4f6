"""Samples that failed, and on_error as one policy that decides what becomes of each.

A `Failure` records a sample that failed at one step: its bytes could not be
read ("read"), it lacks a field its source selects ("field": no tar member
for it, a null Parquet cell where the field needs a value), its bytes could
not be decoded ("decode"), or its header gave no image size, so that it is in
no aspect bucket ("size"). `ErrorPolicy.action` is the one decision, a pure
function of on_error and the failure:

    step      skip     replace                          raise
    decode    skip     replace                          raise
    field     skip     replace                          raise
    read      raise    replace (raise: changed, denied) raise
    size      skip     skip (no slot to fill)           raise

A missing field is the sample's own defect, as bytes that do not decode are;
a read that fails is the store's, and "skip" would hide it. The worker asks
the policy whether to substitute a sample; the iterator, whether to leave a
failed sample out of its batch (logged once per URI and counted) or to raise;
the loader, whether a sample in no bucket stops it. The policy also builds
the errors they raise. Any other error while making a sample is no sample's
fault: `Failure.decode_failed` raises it as a LoaderError, which no mode
hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from raydl.errors import (
    AccessDeniedError,
    DataSourceError,
    DecodeError,
    LoaderError,
    MissingFieldError,
    ObjectChangedError,
    SampleDecodeError,
)
from raydl.options import check_on_error

__all__ = ["Action", "ErrorPolicy", "Failure", "Replaced", "Step"]

Action = Literal["skip", "replace", "raise"]
Step = Literal["read", "field", "decode", "size"]


@dataclass(frozen=True)
class Failure:
    """Sample `sample_id` (named by `uri`) failed at `step` for `reason`."""

    sample_id: int
    uri: str
    reason: str
    step: Step = "decode"
    error: type[DataSourceError] = DataSourceError  # a failed read's error type, raised again by the iterator

    @property
    def unreadable(self) -> bool:
        """The source could not give the sample (its bytes could not be read, or it lacks a field), rather
        than its bytes failing to decode."""
        return self.step in ("read", "field")

    @classmethod
    def read_failed(cls, sample_id: int, uri: str, exc: DataSourceError) -> Failure:
        """A sample whose bytes could not be read, named by the error's URI, else by `uri`."""
        return cls(sample_id, exc.uri or uri, str(exc), step="read", error=type(exc))

    @classmethod
    def source_failed(cls, sample_id: int, shard_uri: str, sample_uri: str, exc: DataSourceError) -> Failure:
        """A sample its source could not give: one that lacks a selected field (a MissingFieldError: the
        sample's own defect, named by `sample_uri`), one whose field cannot decode, known before it is read (a
        SampleDecodeError, such as a label member too large to be one: also its own defect), else one whose
        bytes could not be read (`read_failed`, named by the error's URI, else by `shard_uri`)."""
        if isinstance(exc, MissingFieldError):
            return cls(sample_id, sample_uri, str(exc), step="field", error=MissingFieldError)
        if isinstance(exc, SampleDecodeError):
            return cls(sample_id, sample_uri, str(exc), step="decode", error=SampleDecodeError)
        return cls.read_failed(sample_id, shard_uri, exc)

    @classmethod
    def decode_failed(cls, sample_id: int, uri: str, exc: Exception, *, worker: str) -> Failure:
        """A sample whose bytes did not decode (a DecodeError). Any other error is not the sample's fault:
        it is raised as a LoaderError naming the sample and `worker`."""
        if isinstance(exc, DecodeError):
            return cls(sample_id, uri, str(exc))
        raise LoaderError(
            f"loader worker {worker}: sample {sample_id} ({uri}) failed with "
            f"{type(exc).__name__}: {exc} (not a decode error: on_error does not cover it)"
        ) from exc

    @classmethod
    def unsized(cls, sample_id: int, uri: str, reason: str) -> Failure:
        """A sample whose header gave no image size at listing: it is in no aspect bucket."""
        return cls(sample_id, uri, reason, step="size")


@dataclass(frozen=True)
class Replaced:
    """Sample `sample_id` failed for `reason`; sample `substitute_id` stands in its slot."""

    sample_id: int
    uri: str
    reason: str
    substitute_id: int


@dataclass(frozen=True)
class ErrorPolicy:
    """on_error ("skip", "replace" or "raise") as one decision for every failed sample (see the module)."""

    on_error: str = "skip"

    def __post_init__(self) -> None:
        check_on_error(self.on_error)

    def action(self, failure: Failure) -> Action:
        """What becomes of `failure`'s sample: left out of its batch, substituted, or raised."""
        if failure.step in ("decode", "field"):  # the sample's own defect
            return self.on_error  # type: ignore[return-value]
        if failure.step == "size":  # the plan deals no slot to it, so there is none to fill
            return "raise" if self.on_error == "raise" else "skip"
        # A batch may not silently lose a sample it could read; and no substitute may hide data that
        # changed under the loader, or a denied access.
        hidden = issubclass(failure.error, (ObjectChangedError, AccessDeniedError))
        return "replace" if self.on_error == "replace" and not hidden else "raise"

    def settle(
        self, failures: Sequence[Failure], *, rank: int = 0, epoch: int = 0, batch: int = 0
    ) -> list[Failure]:
        """The failures to leave out of their batch; raises `error` for those `action` does not say to skip,
        if any. A failure to "replace" that comes here was not replaced, and a short batch would break that
        promise: it is raised too."""
        raised = [f for f in failures if self.action(f) != "skip"]
        if raised:
            raise self.error(raised, rank=rank, epoch=epoch, batch=batch)
        return list(failures)

    def error(
        self, failures: Sequence[Failure], *, rank: int = 0, epoch: int = 0, batch: int = 0
    ) -> DataSourceError:
        """The error that names the first of `failures` (and how many more failed at its step), from where
        they surfaced: batch `batch` of `epoch` on `rank`, or, for "size", the loader's construction."""
        first = failures[0]
        alike = sum(f.step == first.step for f in failures)
        more = f" (and {alike - 1} more)" if alike > 1 else ""
        sample = f"sample {first.sample_id} ({first.uri}): {first.reason}"
        if first.step == "read":  # the type the worker saw: DataSourceError, ObjectChangedError, ...
            return first.error(
                f"rank {rank}: batch {batch} of epoch {epoch}: cannot read {sample}{more}", uri=first.uri
            )
        if first.step == "field":
            return MissingFieldError(
                f"rank {rank}: batch {batch} of epoch {epoch}: incomplete {sample}{more}",
                uri=first.uri,
                sample_id=first.sample_id,
            )
        if first.step == "size":
            return SampleDecodeError(
                f"cannot bucket {sample}{more}", uri=first.uri, sample_id=first.sample_id
            )
        return SampleDecodeError(
            f"rank {rank}: cannot decode {sample}", uri=first.uri, sample_id=first.sample_id
        )

    def no_substitute(self, failure: Failure, tried: Sequence[int]) -> SampleDecodeError:
        """The error that fails a batch under "replace" when none of a sample's substitutes decodes."""
        return SampleDecodeError(
            f"sample {failure.sample_id} ({failure.uri}) failed ({failure.reason}) and none of its "
            f"substitutes {list(tried)} could be decoded either; is most of the data bad?",
            uri=failure.uri,
            sample_id=failure.sample_id,
        )
