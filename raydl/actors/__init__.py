"""Plain actor classes; Ray wiring is applied where they are started (raydl/loader.py).

Imported on first use, so that the coordinator's process (raydl.actors.coordinator)
does not import the worker's dependencies (numpy, pyarrow, the decoders).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raydl.actors.loader_worker import BatchResult, BatchTask, LoaderWorker, WorkerSpec

__all__ = ["BatchResult", "BatchTask", "LoaderWorker", "WorkerSpec"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("raydl.actors.loader_worker"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
