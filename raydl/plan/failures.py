"""Samples that failed: what the worker records about each, for the iterator to account for."""

from __future__ import annotations

from dataclasses import dataclass

from raydl.errors import AccessDeniedError, DataSourceError, ObjectChangedError

__all__ = ["Replaced", "Skipped"]


@dataclass(frozen=True)
class Skipped:
    sample_id: int
    uri: str
    reason: str
    unreadable: bool = False  # the bytes could not be read, rather than decoded
    error: type[DataSourceError] = DataSourceError  # the read error's type, raised again by the iterator

    @property
    def fatal(self) -> bool:
        """The data changed under the loader or access is denied: no substitute may hide it."""
        return issubclass(self.error, (ObjectChangedError, AccessDeniedError))

    @classmethod
    def read_failed(cls, sample_id: int, uri: str, exc: DataSourceError) -> Skipped:
        """A sample whose bytes could not be read, named by the error's URI, else by `uri`."""
        return cls(sample_id, exc.uri or uri, str(exc), unreadable=True, error=type(exc))


@dataclass(frozen=True)
class Replaced:
    sample_id: int
    uri: str
    reason: str
    substitute_id: int
