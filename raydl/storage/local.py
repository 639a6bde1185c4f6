"""Local-disk storage: lists a folder and reads files by key (path under the root)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from raydl.errors import DataSourceError

__all__ = ["LocalStorage"]


@dataclass(frozen=True)
class LocalStorage:
    """Files under `root`, addressed by their '/'-separated path relative to it."""

    root: str

    def uri(self, key: str) -> str:
        return os.path.join(self.root, key)

    def walk(self) -> Iterator[tuple[str, int]]:
        """Yield (key, size) for every regular file under root, in no particular order."""
        if not os.path.isdir(self.root):
            what = "is not a directory" if os.path.exists(self.root) else "does not exist"
            raise DataSourceError(f"image root {self.root!r} {what}", uri=self.root)

        def on_error(exc: OSError) -> None:
            raise DataSourceError(f"cannot list {exc.filename!r} under {self.root!r}: {exc}",
                                  uri=exc.filename) from exc

        for dirpath, _dirnames, filenames in os.walk(self.root, onerror=on_error, followlinks=True):
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError as exc:
                    raise DataSourceError(f"cannot stat {path!r}: {exc}", uri=path) from exc
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                yield key, st.st_size

    def read(self, key: str) -> bytes:
        """The whole file; a missing or unreadable file is a DataSourceError naming it."""
        path = self.uri(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise DataSourceError(f"cannot read {path!r}: {exc}", uri=path) from exc
