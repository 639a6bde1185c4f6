"""raydl's one exception tree.

    RaydlError
    ├── DataSourceError        a root, file or object cannot be listed or read (names it)
    │   ├── AccessDeniedError  the store refused access: a permission error (names the bucket)
    │   ├── ObjectChangedError an object changed after it was listed (names it)
    │   └── SampleDecodeError  a sample's bytes cannot be decoded (names the file)
    │       └── MissingFieldError  a sample lacks a field its source selects (names the sample, field, shard)
    ├── DecodeError            (also a ValueError) the decode layer's "these bytes are not an image it can
    │                          decode"; with a failed read and a missing field, the only errors the
    │                          on_error policy covers
    │                          (raydl/plan/failures.py: ErrorPolicy skips, replaces or raises the sample)
    ├── NativeKernelError      a C kernel returned an error code
    ├── FabricError            a libfabric call failed (-FI_E...; names the call, the peer)
    ├── CheckpointError        a checkpoint could not be published or fetched (names the peer, chunk)
    └── LoaderError            the loader's actors failed (names the rank, batch or actor)
        └── BatchTimeoutError  a batch did not arrive in time (also a TimeoutError)

Lower-level errors (OSError, PIL, Ray, libfabric) are translated at the boundary with
`raise ... from exc`, so the original stays in `__cause__`.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "BatchTimeoutError",
    "CheckpointError",
    "DataSourceError",
    "DecodeError",
    "FabricError",
    "LoaderError",
    "MissingFieldError",
    "NativeKernelError",
    "ObjectChangedError",
    "RaydlError",
    "SampleDecodeError",
]


class RaydlError(Exception):
    """Root of every error raydl raises on purpose."""


class DataSourceError(RaydlError):
    """A source (root folder, file, object) cannot be listed or read."""

    def __init__(self, message: str, *, uri: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri

    def __reduce__(self):  # keep the keyword-only field across pickling (Ray)
        return (_rebuild_source_error, (type(self), str(self), self.uri))


class AccessDeniedError(DataSourceError, PermissionError):
    """The store refused access to a bucket or object (HTTP 403): the credentials lack a permission."""


class ObjectChangedError(DataSourceError):
    """An object's etag or size differs from when it was listed; raydl never reads the other bytes."""


def _rebuild_source_error(cls: type, message: str, uri: str | None) -> DataSourceError:
    return cls(message, uri=uri)


class SampleDecodeError(DataSourceError):
    """A sample's bytes could not be decoded into an image."""

    def __init__(self, message: str, *, uri: str, sample_id: int | None = None) -> None:
        super().__init__(message, uri=uri)
        self.sample_id = sample_id

    def __reduce__(self):  # keep the keyword-only fields across pickling (Ray)
        return (_rebuild_decode_error, (str(self), self.uri, self.sample_id))


def _rebuild_decode_error(message: str, uri: str, sample_id: int | None) -> SampleDecodeError:
    return SampleDecodeError(message, uri=uri, sample_id=sample_id)


class MissingFieldError(SampleDecodeError):
    """A sample lacks a field its source selects: no member for it in its tar shard, or a null Parquet cell
    where the field needs a value. Like bytes that do not decode, it is the sample's own defect, so on_error
    settles it (skip, replace or raise), where a failed read is raised under "skip"."""

    def __reduce__(self):  # keep the keyword-only fields, and the type, across pickling (Ray)
        return (_rebuild_missing_field, (str(self), self.uri, self.sample_id))


def _rebuild_missing_field(message: str, uri: str, sample_id: int | None) -> MissingFieldError:
    return MissingFieldError(message, uri=uri, sample_id=sample_id)


class DecodeError(RaydlError, ValueError):
    """A sample's bytes are corrupt, truncated or in a format raydl cannot decode.

    Raised by raydl.native.decode and the native JPEG path, which do not know the
    file; the loader names it when it skips, replaces or raises (SampleDecodeError).
    """


class NativeKernelError(RaydlError):
    """A native kernel reported an error."""


class FabricError(RaydlError):
    """A libfabric call failed: `call` is the function, `code` the positive
    FI_E... errno (0 when not from libfabric, e.g. a timeout), `strerror` fi_strerror's text."""

    def __init__(self, message: str, *, call: str, code: int = 0, strerror: str = "") -> None:
        super().__init__(message)
        self.call = call
        self.code = code
        self.strerror = strerror

    def __reduce__(self):  # keep the keyword-only fields across pickling (Ray)
        return (_rebuild_fabric_error, (str(self), self.call, self.code, self.strerror))


def _rebuild_fabric_error(message: str, call: str, code: int, strerror: str) -> FabricError:
    return FabricError(message, call=call, code=code, strerror=strerror)


class CheckpointError(RaydlError):
    """A checkpoint could not be published or fetched (names the peer, and the chunk when one is at fault)."""


class LoaderError(RaydlError):
    """The loader could not produce a batch (actor failures beyond retries, shutdown)."""


class BatchTimeoutError(LoaderError, TimeoutError):
    """A batch did not arrive within the iterator's timeout."""

    def __init__(self, message: str, *, rank: int, batch_index: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.batch_index = batch_index

    def __reduce__(self):  # keep the keyword-only fields across pickling (Ray)
        return (_rebuild_timeout_error, (str(self), self.rank, self.batch_index))


def _rebuild_timeout_error(message: str, rank: int, batch_index: int) -> BatchTimeoutError:
    return BatchTimeoutError(message, rank=rank, batch_index=batch_index)
