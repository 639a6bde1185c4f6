"""A progress bar on stderr for long runs (benchmarks, indexing shards): redrawn in place on a terminal, a
line now and then in a log, with the time so far and an estimate of the time left."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "eta_s"]


def eta_s(done: int, total: int, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far; None before anything is done."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, (total - done) * elapsed_s / done)


class Progress:
    """`with Progress(total, "label") as bar: ... bar.update(done)`; finishes the line on exit.

    `delay_s`: draw nothing until the run has taken that long (short runs stay quiet). `total=None`: a count
    with no end known (a listing), drawn as the count, its `unit` and the rate so far."""

    def __init__(
        self,
        total: int | None,
        label: str,
        *,
        unit: str = "",
        stream=None,
        width: int = 30,
        log_every_s: float = 10.0,
        delay_s: float = 0.0,
    ) -> None:
        self.known = total is not None
        self.total, self.label, self.width, self.unit = max(1, total or 0), label, width, unit
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.log_every_s = log_every_s
        self.delay_s = delay_s
        self.started = self._last = time.monotonic()
        self.done = 0
        self.drawn = False

    def update(self, done: int, note: str = "") -> None:
        self.done = min(done, self.total) if self.known else done
        now = time.monotonic()
        elapsed = now - self.started
        if elapsed < self.delay_s:
            return
        finished = self.known and self.done >= self.total
        if self.drawn and not self.tty and now - self._last < self.log_every_s and not finished:
            return
        if self.drawn and self.tty and not self.known and now - self._last < 0.1:
            return  # a count is updated often: a terminal redraws it 10 times a second at most
        self._last = now
        if not self.known:
            rate = f", {self.done / elapsed:,.0f}/s" if elapsed > 0 else ""
            line = (
                f"{self.label}: {self.done:,} {self.unit} {elapsed:.0f} s{rate}{'  ' + note if note else ''}"
            )
            self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
            self.stream.flush()
            self.drawn = True
            return
        filled = self.width * self.done // self.total
        left = eta_s(self.done, self.total, elapsed)
        eta = "" if left is None or self.done >= self.total else f", ~{left:.0f} s left"
        line = (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{elapsed:.0f} s{eta}{'  ' + note if note else ''}"
        )
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()
        self.drawn = True

    def __enter__(self) -> Progress:
        self.update(0)
        return self

    def __exit__(self, *exc) -> None:
        if self.drawn and not self.known and exc[0] is None:  # the count it ended at
            self._last = self.started - self.log_every_s
            self.update(self.done, "done")
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
