"""A progress bar on stderr for long benchmark runs: redrawn in place on a terminal, a line now and then in a
log."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """`with Progress(total, "label") as bar: ... bar.update(done)`; finishes the line on exit."""

    def __init__(
        self, total: int, label: str, *, stream=None, width: int = 30, log_every_s: float = 10.0
    ) -> None:
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.log_every_s = log_every_s
        self.started = self._last = time.monotonic()
        self.done = 0

    def update(self, done: int, note: str = "") -> None:
        self.done = min(done, self.total)
        now = time.monotonic()
        if not self.tty and now - self._last < self.log_every_s and self.done < self.total:
            return
        self._last = now
        filled = self.width * self.done // self.total
        line = (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{now - self.started:.0f} s{'  ' + note if note else ''}"
        )
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        self.update(0)
        return self

    def __exit__(self, *exc) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
