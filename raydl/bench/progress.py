"""The benchmarks' progress bar: raydl/util/progress.py (kept here for the bench modules that import it)."""

from __future__ import annotations

from raydl.util.progress import Progress

__all__ = ["Progress"]
